"""Sparse gradients where the backend has no sparse allreduce (NCCL, MPI): averaged by all-gather, in one process.

The hook asks `backend_of(group, device)` which backend reduces the gradient's device; here it is told "nccl", and
the gradient must come out as Gloo's sparse allreduce makes it (3 real workers: tests/comm/test_device_paths.py).
"""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel.comm as comm
from trainaccel.comm import hooks

pytestmark = pytest.mark.usefixtures("one_process_group")


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(30, 4, sparse=True)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.embedding(ids)).square().sum()


def _gradients(monkeypatch, backend: str | None) -> tuple[list[torch.Tensor], list[tuple]]:
    asked = []
    if backend is not None:

        def backend_of(group, device):
            asked.append((backend, device))
            return backend

        monkeypatch.setattr(hooks, "backend_of", backend_of, raising=False)
    torch.manual_seed(0)
    model = DDP(Bag())
    state = comm.register(model, compression="fp16")  # trainaccel's hook, not DDP's own allreduce
    grads = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        model(torch.tensor([3, 7, 3, 29, step, 7])).backward()  # rows repeated: an uncoalesced gradient
        grads.append(model.module.embedding.weight.grad)
    assert state.flat_bytes_sent > 0
    return grads, asked


def test_a_backend_without_sparse_allreduce_gets_the_same_gradient_by_all_gather(monkeypatch):
    expected, _ = _gradients(monkeypatch, None)  # Gloo: its sparse allreduce
    with monkeypatch.context() as patch:
        gathered, asked = _gradients(patch, "nccl")
    assert asked and all(device == torch.device("cpu") for _, device in asked)  # asked for the gradient's device
    for a, b in zip(gathered, expected):
        assert a.is_sparse and a.is_coalesced()
        assert torch.equal(a.indices(), b.indices()) and torch.equal(a.values(), b.values())
