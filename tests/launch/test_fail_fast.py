"""Fail fast, lose nothing: a worker's error stops a `trainaccel run` job at once, and a restart resumes it.

The worker script follows the resume recipe of docs/operations.md; rank 1 raises at step 5 of 10 and
rank 0 checkpoints every 2 steps, so the last checkpoint before the failure is step 4.
"""

import os
import time

import pytest
import torch

from conftest import SCRIPTS, run, trainaccel_cmd

STEPS, FAIL_AT, LAST_CHECKPOINT = 10, 5, 4
MESSAGE = f"rank 1 failed on purpose at step {FAIL_AT}"


def launch(out_dir, *flags, fail=True):
    out_dir.mkdir()
    args = [out_dir, STEPS, *(["--fail-at-step", FAIL_AT] if fail else [])]
    cmd = [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 2, *flags, SCRIPTS / "resume_recipe.py", *args]
    start = time.monotonic()
    proc = run(cmd, timeout=120)
    return proc, time.monotonic() - start


def final(out_dir) -> dict:
    return torch.load(out_dir / "final.pt")


@pytest.mark.multiprocess
def test_failing_worker_stops_the_job_with_its_error(tmp_path):
    proc, elapsed = launch(tmp_path / "job")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert elapsed < 60, f"the job took {elapsed:.1f} s to stop"
    assert MESSAGE in output
    # torchrun's failure report lists every failed worker with the traceback `record` saved; its
    # "Root Cause" may be the other worker's "Connection closed by peer" when both fail in the same second.
    report = proc.stderr[proc.stderr.rindex("Failures:") :]
    assert "Root Cause" in report and MESSAGE in report, report
    assert f"{SCRIPTS / 'resume_recipe.py'} FAILED" in proc.stderr  # titled by the script, not trainaccel's bootstrap
    assert not (tmp_path / "job" / "final.pt").exists(), "the job finished despite the failure"
    assert torch.load(tmp_path / "job" / "checkpoint.pt")["step"] == LAST_CHECKPOINT


@pytest.mark.multiprocess
@pytest.mark.resilience_full  # CI: the same restart on 2 nodes (test_restart_nodes.py, a raised error)
def test_restart_resumes_from_the_last_checkpoint_with_the_same_result(tmp_path):
    proc, _ = launch(tmp_path / "restarted", "--max-restarts", 1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert MESSAGE in proc.stderr  # the first attempt did fail
    resumed = final(tmp_path / "restarted")
    # It really resumed: starting over from step 1 would reach the same parameters too.
    assert resumed["attempt"] == 1
    assert resumed["resumed_from"] == LAST_CHECKPOINT > 0
    assert resumed["ran"] == list(range(LAST_CHECKPOINT + 1, STEPS + 1))

    proc, _ = launch(tmp_path / "uninterrupted", fail=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reference = final(tmp_path / "uninterrupted")
    assert reference["resumed_from"] == 0 and reference["ran"] == list(range(1, STEPS + 1))
    assert reference["params"].keys() == resumed["params"].keys()
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_restarts_give_each_attempt_a_fresh_store(monkeypatch, capsys):
    # torch 2.13 lets a restarted plain init_process_group read the last attempt's addresses from the shared store.
    from trainaccel.launch.run import main

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("TORCH_DISABLE")})
    script = str(SCRIPTS / "resume_recipe.py")
    assert main(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--dry-run", script]) == 0
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().out
    assert main(["--standalone", "--nproc-per-node", "2", "--dry-run", script]) == 0
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in capsys.readouterr().out
