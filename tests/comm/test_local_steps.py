"""trainaccel.comm.LocalSteps: local accumulation over no_sync, one reduction and one step every N passes."""

import pytest
import torch
from torch import nn

from conftest import SCRIPTS, read_ranks, run, torchrun_cmd
from trainaccel.comm import LocalSteps


@pytest.mark.multiprocess
def test_every_n_passes_equals_a_large_batch_step_with_one_reduction(tmp_path):
    proc = run([*torchrun_cmd(), "--standalone", "--nproc-per-node", "2", SCRIPTS / "local_steps.py", tmp_path])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in read_ranks(tmp_path, 2):
        assert r["max_abs_err"] <= 1e-6
        assert r["hook_steps"] == 2  # 8 passes, every=4: the network is used twice
        assert r["syncing"] == [False, False, False, True] * 2
        assert r["grads_cleared"]
    log = proc.stdout + proc.stderr
    assert log.count("local_steps=2 needs trainaccel.comm.LocalSteps") == 1  # zero-code: one warning, rank 0


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "4"])
def test_bad_every_is_refused(every):
    with pytest.raises(ValueError, match=f"invalid every={every!r}; accepted: an integer >= 1"):
        LocalSteps(object(), None, every=every)  # type: ignore[arg-type]


def test_needs_a_ddp_model():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        LocalSteps(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), every=2)  # type: ignore[arg-type]
