"""An unmodified DDP script is accelerated by `trainaccel run`, and only by it (real Gloo workers)."""

import sys

import pytest

from conftest import SCRIPTS, free_port, read_ranks, run, torchrun_cmd, trainaccel_cmd

pytestmark = pytest.mark.multiprocess

SCRIPT = SCRIPTS / "plain_ddp.py"
PARAMS = 32 * 64 + 64 + 64 * 4 + 4  # the script's model


def _train(launcher: list, out, env: dict | None = None, output: list | None = None) -> list[dict]:
    proc = run([*launcher, SCRIPT, "--out-dir", out, "--steps", "20"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if output is not None:
        output.append(proc.stdout + proc.stderr)
    ranks = read_ranks(out, 2)
    assert ranks[0]["params"] == ranks[1]["params"], "replicas diverged"
    assert all(r["last_loss"] < r["first_loss"] for r in ranks), "training did not reduce the loss"
    return ranks


def test_trainaccel_run_registers_the_hook_with_no_code_change(tmp_path):
    output: list[str] = []
    ranks = _train([*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", "2"], tmp_path, output=output)
    config_lines = [line for line in output[0].splitlines() if "trainaccel config:" in line]
    from trainaccel.config import Config

    assert config_lines == [
        f"[trainaccel rank 0] INFO trainaccel config: {Config.resolve(env={}).describe()}"
    ]  # logged once, by rank 0 only, with every option at its default
    for r in ranks:
        # With the defaults on one node trainaccel has nothing to add and runs DDP's own C++ allreduce.
        assert r["comm_hook"] == "BuiltinCommHookType.ALLREDUCE" and r["trainaccel"] is True
        assert r["compression"] == "none" and r["bytes_per_step"] == PARAMS * 4
        assert r["name"] == "__main__"
        assert r["argv"] == [str(SCRIPT), "--out-dir", str(tmp_path), "--steps", "20"]


def test_plain_torchrun_reports_no_hook(tmp_path):
    for r in _train([*torchrun_cmd(), "--standalone", "--nproc-per-node", "2"], tmp_path):
        assert r["comm_hook"] in (None, "") and r["compression"] is None


def test_python_m_trainaccel_launch_flags_beat_env(tmp_path):
    launcher = [
        sys.executable,
        "-m",
        "trainaccel.launch",
        "--nproc_per_node",
        "2",
        "--master-port",
        free_port(),
        "--bucket-mb",
        "1",
        "--compression",
        "fp16",
    ]
    for r in _train(launcher, tmp_path, env={"TRAINACCEL_COMPRESSION": "bf16", "TRAINACCEL_BUCKET_MB": "64"}):
        assert r["comm_hook"] == "trainaccel_comm_hook"
        # 20 steps: the first reduced exactly (before DDP's final buckets), then fp16.
        assert r["compression"] == "fp16" and r["bytes_per_step"] == (PARAMS * 4 + 19 * PARAMS * 2) / 20
        assert r["bucket_bytes_cap"] == 2**20


def test_host_list_on_localhost_trains_configured_by_env_alone(tmp_path):
    for r in _train([*trainaccel_cmd(), "run", "-H", "localhost:2"], tmp_path, env={"TRAINACCEL_COMPRESSION": "bf16"}):
        assert r["world_size"] == 2 and r["trainaccel"] is True
        assert r["compression"] == "bf16"  # no flag: the env reaches the workers through the host plan


def test_a_failing_worker_fails_a_host_list_launch(tmp_path):
    # The torchrun path is tests/launch/test_fail_fast.py's.
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = run([*trainaccel_cmd(), "run", "-H", "localhost:2", bad])
    assert proc.returncode != 0
