"""A checkpoint loaded with map_location="cpu" (docs/operations.md's recipe) into a CUDA model under a lossy codec:
the engine's state (residuals) must follow the model to the GPU, and training go on."""

import io
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import trainaccel
from gpu.helpers import Net, batches, train
from trainaccel.comm import comm_state
from trainaccel.comm.checkpoint import METADATA_KEY
from trainaccel.observer import observer_of

pytestmark = pytest.mark.gpu


def build(device: torch.device, state: dict | None = None) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = Net().to(device)
    if state is not None:
        module.load_state_dict(state)  # before DDP wraps it, as the recipe does
    model = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def saved_and_loaded_on_the_cpu(model: DistributedDataParallel) -> dict:
    buffer = io.BytesIO()
    torch.save(model.module.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location="cpu")
    carried = [m for m in state._metadata.values() if METADATA_KEY in m]
    assert carried, "the state dict carries no engine state: nothing to test"
    return state


def residuals_of(model: DistributedDataParallel) -> list[torch.Tensor]:
    diloco = observer_of(model).diloco
    feedback = diloco.outer.feedback if diloco is not None else comm_state(model).feedback
    return list(feedback.residuals.values())


@pytest.mark.parametrize(
    "options",
    [
        {"compression": "fp16"},
        {"compression": "topk", "compression_ratio": 0.1, "compression_warmup": 1},
        {"compression": "randomk", "compression_ratio": 0.1, "compression_warmup": 1},
        {"sync_every": 2, "outer_compression": "int8"},
    ],
    ids=["fp16", "topk", "randomk", "sync_every-int8"],
)
def test_engine_state_loaded_on_the_cpu_resumes_on_the_gpu(one_worker_env, device, options):
    trainaccel.init(**options)
    model, optimizer = build(device)
    train(model, optimizer, batches(device, 5))
    assert residuals_of(model), "no residuals were kept: nothing to test"
    state = saved_and_loaded_on_the_cpu(model)

    resumed, optimizer = build(device, state)
    losses = train(resumed, optimizer, batches(device, 4, seed=1))  # the engine state meets GPU gradients here
    assert all(math.isfinite(v) for v in losses)
    diloco = observer_of(resumed).diloco
    steps = diloco.steps if diloco is not None else comm_state(resumed).reductions
    assert steps == 5 + 4, "the checkpoint's engine state was not restored (its step count was not)"
    residuals = residuals_of(resumed)
    assert residuals and all(r.device == device for r in residuals), [r.device for r in residuals]
