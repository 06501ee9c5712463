"""trainaccel.convert_sync_batchnorm: global and node scopes on an emulated 2-node x 2-worker job (Gloo, CPU)."""

import pytest
import torch
from torch import nn

from conftest import SCRIPTS, read_ranks, run_nodes
from trainaccel.batchnorm import SyncBatchNorm, convert_sync_batchnorm


@pytest.mark.multiprocess
def test_scopes_normalize_over_the_node_or_every_worker(tmp_path):
    procs = run_nodes(SCRIPTS / "sync_bn_scopes.py", tmp_path, nodes=2, per_node=2)
    assert all(p.returncode == 0 for p in procs), "\n".join(p.stdout[-3000:] for p in procs)
    for rank, result in enumerate(read_ranks(tmp_path, 4)):
        assert result["failures"] == [], f"rank {rank}"


def test_conversion_keeps_parameters_buffers_and_mode():
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.Sequential(nn.BatchNorm1d(2)))
    model[1].running_mean.fill_(0.5)
    model.eval()
    converted = convert_sync_batchnorm(model)
    assert type(converted[1]) is SyncBatchNorm and type(converted[2][0]) is SyncBatchNorm
    assert converted[1].weight is model[1].weight and torch.equal(converted[1].running_mean, torch.full((3,), 0.5))
    assert not converted[1].training and converted[1].process_group is None
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(converted[1](x), model[1](x))  # no process group: plain batch norm


def test_node_scope_needs_the_process_group():
    with pytest.raises(RuntimeError, match="scope='node' needs the process group started"):
        convert_sync_batchnorm(nn.BatchNorm1d(2), scope="node")
