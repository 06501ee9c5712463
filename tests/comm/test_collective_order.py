"""The order in which the engine's collectives and DDP's own are issued: the same on every rank, from one thread.

NCCL may deadlock when ranks issue collectives on two communicators in different orders. The engine issues its own
from its communication thread; DDP's reducer all-reduces its map of used parameters (find_unused_parameters) from the
training thread right after the step's last bucket. So the last bucket's hook returns only once its job has run.
"""

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainaccel.comm import register
from trainaccel.comm.codecs import get_codec
from trainaccel.comm.hooks import CommState, trainaccel_comm_hook
from trainaccel.comm.scheduler import comm_thread


class Bucket:
    """What DDP's GradBucket offers the hook, for one flat buffer."""

    def __init__(self, buffer: torch.Tensor, last: bool):
        self._buffer, self._last = buffer, last

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer]

    def parameters(self) -> list:
        return []

    def is_last(self) -> bool:
        return self._last


@pytest.mark.parametrize("after_last", [True, False])
@pytest.mark.parametrize("last", [True, False])
def test_the_last_buckets_hook_returns_after_its_job_when_ddp_issues_a_collective_next(
    one_process_group, after_last, last
):
    state = CommState(process_group=None, codec=get_codec("fp16"), group=dist.group.WORLD)
    state.ddp_collective_after_last = after_last
    busy = threading.Event()
    # The communication thread is busy with an earlier job for 0.5 s: the hook's job waits behind it.
    comm_thread().submit(lambda: (busy.wait(5.0), torch.zeros(1))[1])
    threading.Timer(0.5, busy.set).start()
    fut = trainaccel_comm_hook(state, Bucket(torch.ones(64), last))
    waited = after_last and last
    assert busy.is_set() == waited and fut.done() == waited
    assert torch.equal(fut.wait(), torch.ones(64))  # a world of one: the mean is the gradient


def test_register_tells_the_hook_when_ddp_reduces_its_map_of_used_parameters(one_process_group):
    for find_unused, static_graph, expected in [(True, False, True), (False, False, False), (True, True, False)]:
        model = DDP(nn.Linear(4, 4), find_unused_parameters=find_unused, static_graph=static_graph)
        state = register(model, compression="fp16")
        assert state.ddp_collective_after_last is expected
        model(torch.ones(2, 4)).sum().backward()  # and it trains through the hook
        assert torch.allclose(model.module.bias.grad, torch.full((4,), 2.0))
        del model
