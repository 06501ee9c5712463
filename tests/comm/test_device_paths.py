"""The sparse-gradient path for backends without a sparse allreduce, and PowerSGD's shared state, on 3 Gloo workers
(scripts/sparse_and_powersgd.py)."""

import pytest

from conftest import SCRIPTS, read_ranks, run, torchrun_cmd

pytestmark = pytest.mark.multiprocess

WORKERS = 3  # three, so that the order in which duplicate rows are added matters


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("paths")
    script = SCRIPTS / "sparse_and_powersgd.py"
    proc = run([*torchrun_cmd(), "--standalone", "--nproc-per-node", WORKERS, script, out])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return read_ranks(out, WORKERS)


def test_sparse_gradients_by_all_gather_equal_glooss_sparse_allreduce_bit_for_bit(ranks):
    for r in ranks:
        assert not [f for f in r["failures"] if "powersgd" not in f], r["failures"]
        # Both paths counted: the summed rows, or the other workers' padded rows and indices.
        assert all(allreduced > 0 and gathered > 0 for allreduced, gathered in r["bytes"].values())


def test_powersgd_p_and_q_are_the_same_on_every_rank_and_its_error_is_each_ranks_own(ranks):
    """So the checkpoint takes P and Q from any rank's file (rank 0's too) and the error only from this rank's."""
    for r in ranks:
        assert "powersgd compressed" not in r["failures"]
        same = r["same_on_every_rank"]
        assert same["p"] and all(same["p"]) and same["q"] and all(same["q"])
        assert same["error"] and not any(same["error"])
