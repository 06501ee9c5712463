"""Two ranks on one GPU over Gloo (which takes CUDA tensors; NCCL refuses two ranks on one device): the engine's
codecs and sync_every keep the replicas equal while the loss falls. The job is tools/gpu_check_steps.py, the script
of tools/gpu-check's options and replicas stages."""

import json
from pathlib import Path

import pytest

from conftest import run, torchrun_cmd

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check_steps.py"
OPTIONS = ["fp16/hier=off", "topk/hier=off", "powersgd/hier=off", "sync_every=2+scope=rank", "sync_every=2+outer=int8"]


def test_two_ranks_on_one_gpu_keep_equal_replicas(tmp_path, device):
    command = [*torchrun_cmd(), "--standalone", "--nproc-per-node", "2", SCRIPT, tmp_path, "--backend", "gloo"]
    command += ["--device", device.type, "--options", ",".join(OPTIONS), "--steps", "20", "--check-replicas"]
    proc = run(command, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        lines = [json.loads(line) for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()]
        results = {r["option"]: r for r in lines if r["event"] == "done"}
        assert list(results) == OPTIONS
        for name, r in results.items():
            assert r["ok"], (name, r.get("error"), r.get("where"))
            assert r["replicas_equal"], (name, r["max_replica_diff"])
            assert r["final_loss"] < 0.9 * r["first_loss"], (name, r["first_loss"], r["final_loss"])
