"""compression=powersgd on a model on the CPU of a machine with a GPU: torch's hook synchronizes CUDA at every bucket."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel
import trainaccel.comm as comm

pytestmark = pytest.mark.usefixtures("one_process_group")

STEPS = 4  # compressing from the third step on (torch's PowerSGD starts after at least 2)


def gradients_after(steps: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    comm.register(ddp, compression="powersgd", compression_warmup=1, hierarchical="off")
    for step in range(steps):
        ddp.zero_grad()
        ddp(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
    assert comm.comm_state(ddp).powersgd.total_numel_after_compression > 0  # it compressed
    return [p.grad.clone() for p in ddp.parameters()]


def test_a_cpu_model_trains_where_cuda_is_available_as_where_it_is_not(monkeypatch):
    expected = gradients_after(STEPS)
    trainaccel.shutdown()
    calls = []

    def synchronize(device=None):  # as torch's on a machine with a GPU: a CPU device is refused
        calls.append(device)
        if isinstance(device, torch.device) and device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device.type}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    got = gradients_after(STEPS)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not calls  # the CPU buckets' synchronizations were passed over
    torch.cuda.synchronize(torch.device("cuda", 0))  # a CUDA device still reaches torch's
    torch.cuda.synchronize()
    assert calls == [torch.device("cuda", 0), None]
    trainaccel.shutdown()
    assert torch.cuda.synchronize is synchronize
