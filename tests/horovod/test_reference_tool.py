"""tools/horovod_reference.py on a made-up suite: one test's failure on some ranks stays in that test."""

import sys
from pathlib import Path

import pytest

from conftest import run

pytestmark = pytest.mark.multiprocess

TOOL = Path(__file__).parents[2] / "tools" / "horovod_reference.py"

SUITE = """
import unittest

import torch

import horovod.torch as hvd


class TorchTests(unittest.TestCase):
    def tearDown(self):  # as in Horovod's suite
        if hvd.is_initialized():
            hvd.barrier()
            hvd.shutdown()

    def test_a_fails_on_rank_0_only(self):
        hvd.init()
        for step in range(3):
            assert not (hvd.rank() == 0 and step == 1), "rank 0 fails at step 1; the others go on"
            hvd.allreduce(torch.ones(2))

    def test_b_reinit(self):
        hvd.init()
        hvd.shutdown()
        hvd.init()
        self.assertEqual(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist(), [hvd.size()] * 2)

    def test_c_allgather(self):
        hvd.init()
        self.assertEqual(hvd.allgather(torch.full((1,), float(hvd.rank()))).tolist(), [float(k) for k in range(hvd.size())])
"""


def test_a_failure_on_some_ranks_does_not_spill_into_the_next_tests(tmp_path):
    suite = tmp_path / "horovod" / "test" / "parallel" / "test_torch.py"
    suite.parent.mkdir(parents=True)
    suite.write_text(SUITE)
    proc = run([sys.executable, TOOL, tmp_path / "horovod", "--nproc", 2, "--out", tmp_path / "out"], timeout=200)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert any(line.startswith("failed   test_a_fails_on_rank_0_only") for line in lines), proc.stdout
    assert "passed   test_b_reinit" in lines and "passed   test_c_allgather" in lines, proc.stdout + proc.stderr
    assert "2 workers: 2 passed, 1 failed, 0 skipped" in lines


MPI_SUITE = """
import os
import unittest

import torch
import torch.distributed as dist

import horovod.torch as hvd

first_group = []


class TorchTests(unittest.TestCase):
    def tearDown(self):  # as in Horovod's suite: under mpirun, Horovod stays up between tests
        if hvd.is_initialized() and os.getenv("HOROVOD_RANK") is not None:
            hvd.barrier()
            hvd.shutdown()

    def test_a_leaves_a_named_operation(self):
        hvd.init()
        self.assertEqual(hvd.rank(), int(os.environ["OMPI_COMM_WORLD_RANK"]))
        first_group.append(dist.group.WORLD)
        hvd.allreduce_async(torch.ones(2), name="left")

    def test_b_same_process_group(self):
        hvd.init()
        self.assertIs(dist.group.WORLD, first_group[0])
        self.assertEqual(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist(), [hvd.size()] * 2)
        # That collective freed test_a's name on every rank.
        self.assertEqual(hvd.allreduce(torch.ones(2), name="left", op=hvd.Sum).tolist(), [hvd.size()] * 2)
"""


def test_under_mpirun_the_tests_share_one_process_group(tmp_path):
    suite = tmp_path / "horovod" / "test" / "parallel" / "test_torch.py"
    suite.parent.mkdir(parents=True)
    suite.write_text(MPI_SUITE)
    cmd = [sys.executable, TOOL, tmp_path / "horovod", "--nproc", 2, "--launcher", "mpirun", "--out", tmp_path / "out"]
    proc = run(cmd, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 workers: 2 passed, 0 failed, 0 skipped" in proc.stdout.splitlines(), proc.stdout + proc.stderr
