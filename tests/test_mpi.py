"""`trainaccel.init()` under an mpirun-style start: only OMPI_COMM_WORLD_* and MASTER_* are set."""

import os
import subprocess
import sys

import pytest

from conftest import SCRIPTS, free_port, read_ranks

pytestmark = pytest.mark.multiprocess

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _mpi_env(rank: int, size: int, extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCH_VARS and not k.startswith("TRAINACCEL_")}
    env.update(
        OMPI_COMM_WORLD_RANK=str(rank),
        OMPI_COMM_WORLD_SIZE=str(size),
        OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
        OMPI_COMM_WORLD_LOCAL_SIZE=str(size),
        **extra,
    )
    return env


def test_init_brings_up_the_process_group_from_open_mpi_variables(tmp_path):
    extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen([sys.executable, SCRIPTS / "mpi_init.py", tmp_path], env=_mpi_env(r, 2, extra))
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    ranks = read_ranks(tmp_path, 2)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["world_size"] == 2 and r["local_world_size"] == 2 and r["local_rank"] == r["rank"]
        assert r["allreduce_sum"] == 3.0  # 1 + 2: both ranks really joined one group
        assert r["backend"] == "gloo"
        assert r["trainaccel"] is True  # DDP imported before init() is patched too
        assert r["comm_hook"] == "BuiltinCommHookType.ALLREDUCE"  # defaults on one node: DDP's own allreduce


def test_missing_master_address_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, SCRIPTS / "mpi_init.py", tmp_path],
        env=_mpi_env(0, 2, {}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "MASTER_ADDR and MASTER_PORT not set" in proc.stderr and "mpirun -x MASTER_ADDR" in proc.stderr
