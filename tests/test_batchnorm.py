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


@pytest.mark.parametrize("n, reads", [(8, 0), (1, 1)])
def test_gathered_statistics_read_nothing_on_the_host_unless_a_rank_has_one_value(monkeypatch, n, reads):
    # On a GPU a host read waits for the device, once per BatchNorm layer per step: only a rank whose own batch has
    # at most one value per channel needs the joined count (to refuse a single-value batch as BatchNorm does).
    from trainaccel.batchnorm import gathered_batch_norm, running_stats_factor

    seen = []
    original = torch.Tensor.__int__
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: seen.append(t) or original(t))
    bn = nn.BatchNorm1d(3)
    x = torch.randn(n, 3)
    if n == 1:
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            gathered_batch_norm(bn, x, running_stats_factor(bn), None)
    else:
        out = gathered_batch_norm(bn, x, running_stats_factor(bn), None)
        reference = nn.BatchNorm1d(3)
        torch.testing.assert_close(out, reference(x))
        torch.testing.assert_close(bn.running_var, reference.running_var)
    assert len(seen) == reads
