"""trainaccel.horovod on 2 and 3 real Gloo workers under `trainaccel run`."""

import pytest

from conftest import run, run_checks


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [3])  # 3 splits unevenly; 2 added only time
def test_collectives_and_errors(tmp_path, workers):
    ranks = run_checks("horovod_collectives.py", tmp_path, workers, workers)
    # Every rank raised the same error, naming each rank's shape.
    messages = {r["errors"]["shape mismatch"] for r in ranks}
    assert len(messages) == 1
    assert "rank 0 (2,), rank 1 (3,)" in messages.pop()


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [3])  # 3 splits unevenly; 2 added only time
def test_process_sets_join_gradients_and_reinit(tmp_path, workers):
    ranks = run_checks("horovod_more.py", tmp_path, workers)
    # Errors inside a process set name global ranks; after join only allreduce goes on.
    if workers == 3:
        assert (
            ranks[0]["errors"]["mismatch in a set"]
            == "allreduce: tensor shapes differ across ranks (rank 0 (1,), rank 2 (3,))"
        )
    assert ranks[1]["errors"]["allgather after join"].startswith("allgather: ranks [0] have joined")


@pytest.mark.multiprocess
def test_single_process_is_a_job_of_one():
    code = (
        "import torch, trainaccel.horovod as hvd; hvd.init(); "
        "assert (hvd.size(), hvd.rank(), hvd.local_size()) == (1, 0, 1); "
        "assert torch.equal(hvd.allreduce(torch.ones(2)), torch.ones(2)); "
        "assert torch.equal(hvd.allgather(torch.ones(2, 1)), torch.ones(2, 1)); hvd.shutdown(); "
        "assert not hvd.is_initialized()"
    )
    import sys

    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr


def test_calls_before_init_say_so():
    import trainaccel.horovod as hvd

    with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)"):
        hvd.size()
