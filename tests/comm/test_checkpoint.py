"""`trainaccel.comm.state_dict` / `load_state_dict` in one process (world size 1; the restart itself: test_resume)."""

import io
import logging

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel.comm as comm
from trainaccel.comm.buckets import follow_bucket

pytestmark = pytest.mark.usefixtures("one_process_group")


def trained(compression: str, steps: int = 3, model: nn.Module | None = None) -> DDP:
    torch.manual_seed(0)
    ddp = DDP(model or nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    comm.register(ddp, compression=compression, compression_ratio=0.1, hierarchical="off", compression_warmup=1)
    for step in range(steps):
        torch.manual_seed(step)
        ddp(torch.randn(4, 8)).sum().backward()
    return ddp


def saved_and_loaded(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # weights_only: the state holds tensors and plain values only


@pytest.mark.parametrize("compression", ["fp16", "topk", "randomk", "powersgd"])
def test_the_state_survives_a_weights_only_round_trip_and_restores_every_bucket(compression):
    ddp = trained(compression)
    state = saved_and_loaded(comm.state_dict(ddp))
    assert state["compression"] == compression and state["counters"]["steps"] == 3 and state["buckets"]
    fresh = trained(compression, steps=0)
    comm.load_state_dict(fresh, state)
    restored = comm.comm_state(fresh)
    assert restored.reductions == restored.reductions_at_start == 3
    assert set(restored.restored_buckets.values()) == set(restored.parked) != set()
    again = comm.state_dict(fresh)  # before its first step: what was loaded, unchanged
    for a, b in zip(state["buckets"], again["buckets"]):
        assert a.keys() == b.keys() and a["params"] == b["params"]
        for name in a.keys() - {"params", "index"}:
            for (_, x), (_, y) in zip(a[name], b[name]):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_a_state_for_another_codec_is_not_restored_and_says_so(caplog):
    state = comm.state_dict(trained("topk"))
    fresh = trained("randomk", steps=0)
    with caplog.at_level(logging.WARNING, "trainaccel"):
        comm.load_state_dict(fresh, state)
    assert "is for compression=topk" in caplog.text and "not restored" in caplog.text
    assert comm.comm_state(fresh).reductions == 0 and not comm.comm_state(fresh).parked


def test_an_unknown_format_is_refused_with_the_formats():
    with pytest.raises(ValueError, match="format 99.*reads format 1"):
        comm.load_state_dict(trained("topk", steps=0), {"format": 99})


def test_bucket_state_follows_its_parameters_when_ddp_renumbers_the_buckets():
    state = comm.comm_state(trained("topk"))
    ((index, signature),) = state.signatures.items()
    residual = state.feedback.residuals[index]
    follow_bucket(state, index, (99,))  # another bucket at that index: the residual is parked under its parameters
    assert index not in state.feedback.residuals and state.parked[signature]["residual"][None] is residual
    follow_bucket(state, 5, signature)  # its parameters at a new index: the residual comes along
    assert state.feedback.residuals[5] is residual and signature not in state.parked


def test_the_model_state_dict_carries_it_in_metadata_so_strict_loads_still_match():
    ddp = trained("topk")
    saved = saved_and_loaded(ddp.state_dict())
    assert saved._metadata["module"]["trainaccel_comm"]["compression"] == "topk"
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    plain.load_state_dict({k.removeprefix("module."): v for k, v in saved.items()})  # strict: no extra keys
