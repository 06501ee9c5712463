"""Restart and shrink on emulated nodes: after a fault on another node, `--max-restarts` resumes every node from
the last checkpoint and ends with the uninterrupted run's parameters; with torchrun's elastic `--nnodes 1:2`,
losing a node continues at the smaller size from the last checkpoint."""

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import SCRIPTS, free_port, run_nodes, trainaccel_cmd

pytestmark = pytest.mark.multiprocess

STEPS, FAIL_AT, EVERY = 20, 15, 2
LAST_CHECKPOINT = (FAIL_AT - 1) // EVERY * EVERY
# Steps of 0.3 s: the heartbeats have measured steps by the fault, so the judge and the watchdog act within
# hang_timeout (5 s), not the collective timeout.
RECIPE = ["--every", EVERY, "--step-s", 0.3]
LAUNCHER = [*trainaccel_cmd(), "run", "--hang-timeout", 5, "--collective-timeout", 60]


def _final(out) -> dict:
    return torch.load(out / "final.pt")


FAULTS = ["raise", "kill", "hang", "stop"]


def _job(out, fault):
    """Run the recipe on 2 nodes (with `fault` and a restart, or neither); returns (final.pt, outputs)."""
    args = [out, STEPS, *RECIPE, *(["--fail-at-step", FAIL_AT, "--fault", fault] if fault else [])]
    launcher = [*LAUNCHER, *(["--max-restarts", 1] if fault else [])]
    done = run_nodes(SCRIPTS / "resume_recipe.py", *args, per_node=1, launcher=launcher)
    outputs = [p.stdout for p in done]
    assert all(p.returncode == 0 for p in done), "\n".join(o[-4000:] for o in outputs)
    return _final(out), outputs


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    # All at once: the jobs mostly wait (steps of 0.3 s, the hang deadline, the watchdog).
    runs = [None, *FAULTS]
    with ThreadPoolExecutor(len(runs)) as pool:
        results = pool.map(lambda fault: _job(tmp_path_factory.mktemp(fault or "uninterrupted"), fault), runs)
        return dict(zip(runs, results))


@pytest.mark.parametrize("fault", FAULTS)
def test_every_node_restarts_from_the_last_checkpoint_with_the_uninterrupted_result(jobs, fault):
    (reference, _), (resumed, outputs) = jobs[None], jobs[fault]
    assert f"rank 1 meets fault {fault} at step {FAIL_AT}" in outputs[1], outputs[1][-4000:]
    assert resumed["attempt"] == 1 and resumed["resumed_from"] == LAST_CHECKPOINT, outputs[0][-4000:]
    assert resumed["ran"] == list(range(LAST_CHECKPOINT + 1, STEPS + 1))
    assert reference["ran"] == list(range(1, STEPS + 1)) and reference["world"] == resumed["world"] == 2
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def _elastic_nodes(script, *args, env=None) -> list[subprocess.CompletedProcess]:
    """`script` on 2 loopback nodes under torchrun's elastic `--nnodes 1:2`; node 0 hosts the rendezvous."""
    port = free_port()
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shrink"]
    procs = []
    for node in range(2):
        conf = f"is_host={'true' if node == 0 else 'false'},last_call_timeout=1"
        command = [*LAUNCHER, "--nnodes", "1:2", "--nproc-per-node", 1, "--max-restarts", 1, *rendezvous]
        procs.append(
            subprocess.Popen(
                [str(c) for c in [*command, "--rdzv-conf", conf, script, *args]],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, **(env or {})},
            )
        )
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0, outputs[0][-4000:]
    assert procs[1].returncode == -9, outputs[1][-4000:]  # the lost node's launcher
    return [subprocess.CompletedProcess(p.args, p.returncode, out, "") for p, out in zip(procs, outputs)]


def test_losing_a_node_under_elastic_nnodes_continues_at_the_smaller_size_from_the_last_checkpoint(tmp_path):
    args = [tmp_path, STEPS, *RECIPE, "--fail-at-step", FAIL_AT, "--fault", "lose-node"]
    done = _elastic_nodes(SCRIPTS / "resume_recipe.py", *args)
    resumed = _final(tmp_path)
    assert resumed["world"] == 1 and resumed["attempt"] == 1, done[0].stdout[-4000:]
    assert resumed["resumed_from"] == LAST_CHECKPOINT
    assert resumed["ran"] == list(range(LAST_CHECKPOINT + 1, STEPS + 1))


def test_losing_a_node_under_hvd_elastic_continues_at_the_smaller_size_from_the_last_commit(tmp_path):
    crash_step = 7
    env = {"TRAINACCEL_ELASTIC_DIR": str(tmp_path / "state")}
    args = [tmp_path, "shrink", "--crash-step", crash_step, "--crash-kind", "lose-node", "--epochs", 1]
    done = _elastic_nodes(SCRIPTS / "horovod_elastic.py", *args, env=env)
    output = done[0].stdout
    assert f"hvd.elastic: resumed from commit {crash_step} (world size 2 -> 1" in output, output[-4000:]
    events = [json.loads(line) for line in (tmp_path / "shrink-1-rank0.jsonl").read_text().splitlines()]
    # The reset callbacks ran (the world size changed), then training went on from the commit, alone.
    assert events[:2] == [{"event": "reset", "size": 1}, {"event": "start", "epoch": 0, "step": crash_step, "size": 1}]
    assert (tmp_path / "shrink-params.pt").exists()  # it trained to the end, alone
