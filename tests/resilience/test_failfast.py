"""Fail fast: a collective timeout instead of torch's 30 minutes, and errors that name the missing peer."""

import re
import subprocess
import time

import pytest

from conftest import SCRIPTS, free_port, trainaccel_cmd

TIMEOUT_S = 5


def _start(*args) -> subprocess.Popen:
    return subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.multiprocess
def test_a_hung_or_dead_peer_ends_the_job_with_an_error_naming_it():
    began = time.monotonic()
    # Both jobs at once (they mostly wait): one rank hangs; one emulated node's only worker dies.
    hung = _start(
        *trainaccel_cmd(),
        "run",
        "--standalone",
        "--nproc-per-node",
        2,
        "--collective-timeout",
        TIMEOUT_S,
        SCRIPTS / "stall_at_step.py",
        "hang",
        5,
        1,
    )
    sharded = _start(  # the same, with the DDP model built sharded (FSDP2's collectives time out)
        *trainaccel_cmd(),
        "run",
        "--standalone",
        "--nproc-per-node",
        2,
        "--collective-timeout",
        TIMEOUT_S,
        "--shard",
        "full",
        SCRIPTS / "stall_at_step.py",
        "hang",
        5,
        1,
    )
    port = free_port()
    nodes = [
        _start(
            *trainaccel_cmd(),
            "run",
            "--nnodes",
            2,
            "--node-rank",
            node,
            "--nproc-per-node",
            1,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            SCRIPTS / "stall_at_step.py",
            "die",
            5,
            1,
        )
        for node in range(2)
    ]
    try:
        hung_out, _ = hung.communicate(timeout=150)
        hung_s = time.monotonic() - began
        node_outs = [p.communicate(timeout=150)[0] for p in nodes]
        sharded_out, _ = sharded.communicate(timeout=150)
    finally:
        for p in (hung, sharded, *nodes):
            p.kill()
    # torch's default would have waited 30 minutes; the sleeping rank sleeps 120 s, so an end before it woke
    # (with start-up: ten processes importing torch on a loaded machine took 72 s) is the timeout's.
    assert hung.returncode != 0 and hung_s < 110, hung_out[-3000:]
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in hung_out, hung_out[-3000:]
    named = r"trainaccel: a collective failed on rank 0 at step 6; missing peers: rank 1 \(host \S+, node 0, local rank 1\): "
    assert re.search(named + r"alive but at step 5, behind this rank's step 6", hung_out), hung_out[-3000:]
    assert sharded.returncode != 0, sharded_out[-3000:]
    assert re.search(named + r"alive but at step 5, behind this rank's step 6", sharded_out), sharded_out[-3000:]

    assert all(p.returncode != 0 for p in nodes), node_outs[0][-3000:]
    # The killed worker cannot say why it ended: its node's launcher publishes it, before rank 0's own note.
    named = r"trainaccel: ending rank 0: rank 1 \(host \S+, node 1, local rank 0\) failed first: "
    assert re.search(named + r"its process was ended by SIGKILL \(signal 9\)", node_outs[0]), node_outs[0][-3000:]


def test_timeouts_apply_to_groups_created_without_one():
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    import trainaccel
    from trainaccel.resilience.failfast import set_collective_timeout

    set_collective_timeout(12.5)
    try:
        assert distributed_c10d._get_default_timeout("gloo") == timedelta(seconds=12.5)
    finally:
        trainaccel.shutdown()
    assert distributed_c10d._get_default_timeout("gloo") == timedelta(minutes=30)


def test_the_default_collective_timeout_keeps_nccls_own():
    """A rank-0 save with the others in a barrier has as long as under plain torchrun on NCCL (600 s)."""
    from trainaccel.config import Config

    assert Config.resolve(env={}).collective_timeout == 600.0


@pytest.mark.parametrize("backend, shown", [("cpu:gloo,cuda:nccl", True), ("nccl", True), ("gloo", False)])
def test_stacks_are_shown_on_abort_where_nccls_watchdog_may_end_the_process(monkeypatch, backend, shown):
    """NCCL's watchdog ends a worker whose collective timed out with abort(): no Python error, so the stacks."""
    import faulthandler
    import sys

    import torch.distributed as dist

    import trainaccel
    from trainaccel.resilience.failfast import show_stacks_on_abort

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    was = faulthandler.is_enabled()  # pytest's own
    faulthandler.disable()
    try:
        show_stacks_on_abort()
        assert faulthandler.is_enabled() is shown
        trainaccel.shutdown()
        assert not faulthandler.is_enabled()
    finally:
        if was:
            faulthandler.enable(file=sys.stderr)
