"""Restart and shrink on emulated nodes: after a fault on another node, `--max-restarts` resumes every node from
the last checkpoint and ends with the uninterrupted run's parameters; with torchrun's elastic `--nnodes 1:2`,
losing a node continues at the smaller size from the last checkpoint."""

import functools
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import SCRIPTS, free_port, run_nodes, selected_params, trainaccel_cmd

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
# CI restarts after a published failure and after a judged hang; a kill and a stop (which its launcher's watchdog
# publishes) reach the same restart, and tests/launch/test_faults.py sees each of them end every node.
FULL = pytest.mark.resilience_full
# CI: raise (a hung peer is named and ends the job in tests/resilience/test_failfast.py); the rest in the full set.
CASES = ["raise", pytest.param("kill", marks=FULL), pytest.param("hang", marks=FULL), pytest.param("stop", marks=FULL)]


def _job(out, fault=None):
    """Run the recipe on 2 nodes (with `fault` and a restart, or neither); returns (final.pt, outputs)."""
    args = [out, STEPS, *RECIPE, *(["--fail-at-step", FAIL_AT, "--fault", fault] if fault else [])]
    launcher = [*LAUNCHER, *(["--max-restarts", 1] if fault else [])]
    done = run_nodes(SCRIPTS / "resume_recipe.py", *args, per_node=1, launcher=launcher)
    outputs = [p.stdout for p in done]
    assert all(p.returncode == 0 for p in done), "\n".join(o[-4000:] for o in outputs)
    return _final(out), outputs


CRASH_COMMIT = 7  # hvd.elastic: the commit at which node 1 is lost


def _shrink_recipe(out):
    args = [STEPS, *RECIPE, "--fail-at-step", FAIL_AT, "--fault", "lose-node"]
    return _elastic_nodes(SCRIPTS / "resume_recipe.py", out, *args)


def _shrink_hvd(out):
    env = {"TRAINACCEL_ELASTIC_DIR": str(out / "state")}
    args = ["shrink", "--crash-step", CRASH_COMMIT, "--crash-kind", "lose-node", "--epochs", 1]
    return _elastic_nodes(SCRIPTS / "horovod_elastic.py", out, *args, env=env)


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    # All at once: the jobs mostly wait (steps of 0.3 s, the hang deadline, the watchdog, the rendezvous). Only the
    # faults of the tests selected: each job is 2 nodes' launchers and workers.
    chosen = selected_params(request, "fault")
    faults = [fault for fault in FAULTS if fault in chosen]
    runs = {
        **{fault: functools.partial(_job, fault=fault) for fault in [None, *faults]},
        "shrink-recipe": _shrink_recipe,
        "shrink-hvd": _shrink_hvd,
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {
            name: pool.submit(job, tmp_path_factory.mktemp(name or "uninterrupted")) for name, job in runs.items()
        }
        return {name: future for name, future in futures.items()}


@pytest.mark.parametrize("fault", CASES)
def test_every_node_restarts_from_the_last_checkpoint_with_the_uninterrupted_result(jobs, fault):
    (reference, _), (resumed, outputs) = jobs[None].result(), jobs[fault].result()
    assert f"rank 1 meets fault {fault} at step {FAIL_AT}" in outputs[1], outputs[1][-4000:]
    assert resumed["attempt"] == 1 and resumed["resumed_from"] == LAST_CHECKPOINT, outputs[0][-4000:]
    assert resumed["ran"] == list(range(LAST_CHECKPOINT + 1, STEPS + 1))
    assert reference["ran"] == list(range(1, STEPS + 1)) and reference["world"] == resumed["world"] == 2
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def _elastic_nodes(script, out, *args, env=None) -> tuple:
    """`script` on 2 loopback nodes under torchrun's elastic `--nnodes 1:2`; node 0 hosts the rendezvous."""
    port = free_port()
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shrink"]
    procs = []
    for node in range(2):
        conf = f"is_host={'true' if node == 0 else 'false'},last_call_timeout=1"
        command = [*LAUNCHER, "--nnodes", "1:2", "--nproc-per-node", 1, "--max-restarts", 1, *rendezvous]
        procs.append(
            subprocess.Popen(
                [str(c) for c in [*command, "--rdzv-conf", conf, script, out, *args]],
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
    return out, [subprocess.CompletedProcess(p.args, p.returncode, output, "") for p, output in zip(procs, outputs)]


def _survived(done) -> str:
    """Node 0 ended its job; node 1's launcher was killed with its worker. Returns node 0's output."""
    assert done[0].returncode == 0, done[0].stdout[-4000:]
    assert done[1].returncode == -9, done[1].stdout[-4000:]
    return done[0].stdout


def test_losing_a_node_under_elastic_nnodes_continues_at_the_smaller_size_from_the_last_checkpoint(jobs):
    out, done = jobs["shrink-recipe"].result()
    output = _survived(done)
    resumed = _final(out)
    assert resumed["world"] == 1 and resumed["attempt"] == 1, output[-4000:]
    assert resumed["resumed_from"] == LAST_CHECKPOINT
    assert resumed["ran"] == list(range(LAST_CHECKPOINT + 1, STEPS + 1))


def test_losing_a_node_under_hvd_elastic_continues_at_the_smaller_size_from_the_last_commit(jobs):
    out, done = jobs["shrink-hvd"].result()
    output = _survived(done)
    assert f"hvd.elastic: resumed from commit {CRASH_COMMIT} (world size 2 -> 1" in output, output[-4000:]
    events = [json.loads(line) for line in (out / "shrink-1-rank0.jsonl").read_text().splitlines()]
    # The reset callbacks ran (the world size changed), then training went on from the commit, alone.
    start = {"event": "start", "epoch": 0, "step": CRASH_COMMIT, "size": 1}
    assert events[:2] == [{"event": "reset", "size": 1}, start]
    assert (out / "shrink-params.pt").exists()  # it trained to the end, alone
