"""A resumed engine's state lives where the model's parameters are, whatever `map_location` the load used.

The usual recipe loads a checkpoint with `map_location="cpu"`; on a GPU the residuals, velocities and PowerSGD's
factors must then join the CUDA gradients they are added to. Without a GPU, a model on the `meta` device stands in
for the CUDA one: a real torch.save / torch.load(map_location="cpu") round trip, loaded into it, must leave every
engine tensor on meta.
"""

import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel.comm as comm

pytestmark = pytest.mark.usefixtures("one_process_group")

OPTIONS = dict(compression_ratio=0.1, hierarchical="off", compression_warmup=1)
# What each codec keeps per bucket (topk with DGC's momentum: a velocity beside the residual).
STORES = {
    "topk": {"residual", "velocity"},
    "randomk": {"residual", "rounds"},
    "fp16": {"residual", "scales"},
    "powersgd": {"powersgd_error", "powersgd_p", "powersgd_q"},
}


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _options(compression: str) -> dict:
    momentum = 0.9 if compression == "topk" else "auto"
    return dict(OPTIONS, compression=compression, compression_momentum=momentum)


def _checkpoint(compression: str) -> dict:
    """The model's state_dict after 4 steps on the CPU, through torch.save and torch.load(map_location="cpu")."""
    ddp = DDP(_module())
    comm.register(ddp, **_options(compression))
    for step in range(4):
        ddp(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
    buffer = io.BytesIO()
    torch.save(ddp.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu")


def _engine_tensors(state) -> dict[str, torch.Tensor]:
    return {
        f"{name}[{rest}]": value
        for entries in state.parked.values()
        for name, values in entries.items()
        for rest, value in values.items()
        if isinstance(value, torch.Tensor)
    }


@pytest.mark.parametrize("before_wrapping", [False, True], ids=["into the DDP model", "into the module, then wrapped"])
@pytest.mark.parametrize("compression", list(STORES))
def test_a_cpu_checkpoint_restores_the_engine_state_on_the_parameters_device(compression, before_wrapping):
    saved = _checkpoint(compression)
    engine = saved._metadata["module"]["trainaccel_comm"]
    module = _module().to("meta")  # where the parameters train: a GPU's stand-in
    if before_wrapping:  # the torchrun recipe: load into the module, then wrap it
        comm.load_state_dict(module, engine)
    ddp = DDP(module, init_sync=False)
    state = comm.register(ddp, **_options(compression))
    if not before_wrapping:
        comm.load_state_dict(ddp, engine)
    assert state.reductions == 4
    assert {name for entries in state.parked.values() for name in entries} == STORES[compression]
    tensors = _engine_tensors(state)
    devices = {name: t.device.type for name, t in tensors.items()}
    assert devices and devices == dict.fromkeys(devices, "meta")
    # The stores as saved, moved: same shapes and dtypes.
    saved_tensors = [
        value
        for bucket in engine["buckets"]
        for name, pairs in bucket.items()
        if name not in ("params", "index")
        for _, value in pairs
        if isinstance(value, torch.Tensor)
    ]
    assert sorted((tuple(t.shape), t.dtype) for t in tensors.values()) == sorted(
        (tuple(t.shape), t.dtype) for t in saved_tensors
    )
