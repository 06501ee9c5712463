"""What the framework clients share: the one-line `init()` form, what each rank observes, and its JSON report.

Every client trains STEPS optimizer steps and writes OUT_DIR/rank{r}.json; tests/frameworks/test_matrix.py reads them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch

STEPS = 12  # optimizer steps: under --sync-every 4 the replicas sync at 4, 8 and 12
MID = 6  # a step between syncs: there each rank's replica has trained alone for two steps


def parse() -> argparse.Namespace:
    """OUT_DIR, and `--init k=v,...`: call `trainaccel.init(k=v, ...)` first, the one-line form under torchrun."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--init", default=None, help="options for trainaccel.init(), e.g. compression=fp16")
    args = parser.parse_args()
    if args.init is not None:
        import trainaccel

        trainaccel.init(**init_options(args.init))
    return args


def init_options(text: str) -> dict[str, Any]:
    options = dict(item.split("=", 1) for item in text.split(",") if item)
    return {k: int(v) if v.isdigit() else v for k, v in options.items()}


def digest(tensors) -> str:
    """sha256 of the tensors' values in order; a sharded parameter is gathered whole (call it on every rank)."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for t in tensors:
        t = t.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        h.update(t.float().contiguous().numpy().tobytes())
    return h.hexdigest()


def last_linear(module: torch.nn.Module) -> torch.nn.Module:
    """The module's last nn.Linear (GPT-2's head: its other layers are Conv1D, and an embedding is never autocast)."""
    return [m for m in module.modules() if isinstance(m, torch.nn.Linear)][-1]


class Recorder:
    """Collects one rank's observations of the user's module `module` (the one DDP or the framework wraps)."""

    def __init__(self, module: torch.nn.Module):
        import torch.distributed as dist

        self.module = module
        self.data: dict[str, Any] = {"losses": [], "out_dtype": None, "dtensor": None, "live_mid": None}
        self.data["rank"] = int(os.environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0))
        self.data["world"] = int(os.environ.get("WORLD_SIZE", "1"))
        last_linear(module).register_forward_hook(self._forward)
        # The most elements one torch.distributed.broadcast carried from here on (the framework's, trainaccel's): under
        # sync_every a DDP model's first step does not send the model DDP has just broadcast as it wrapped it.
        self.data["largest_broadcast"] = 0
        broadcast = dist.broadcast

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.data["largest_broadcast"] = max(self.data["largest_broadcast"], tensor.numel())
            return broadcast(tensor, *args, **kwargs)

        dist.broadcast = counted

    def _forward(self, layer: torch.nn.Module, args: tuple, output: Any) -> None:
        # The output dtype in the first training forward tells whether autocast is on.
        if self.data["out_dtype"] is None and layer.training and torch.is_grad_enabled():
            self.data["out_dtype"] = str(output.dtype).removeprefix("torch.")

    def loss(self, value: torch.Tensor) -> None:
        self.data["losses"].append(float(value.detach().float()))

    def at_step(self, step: int) -> None:
        """After optimizer step `step` (1-based), on every rank: FSDP2 shards (outside a forward, which gathers them
        whole), and the live parameters between syncs. Rank LOSE_RANK is killed (SIGKILL) after step LOSE_AT."""
        if step == int(os.environ.get("LOSE_AT", "0")) and self.data["rank"] == int(os.environ.get("LOSE_RANK", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 1:
            from torch.distributed.tensor import DTensor

            self.data["dtensor"] = all(isinstance(p, DTensor) for p in self.module.parameters())
        if step == MID:
            self.data["live_mid"] = digest(p for _, p in self.module.named_parameters())

    def finish(self, ddp: Any, out: str, steps: int = STEPS, optimizer: Any = None) -> None:
        """On every rank, after training: what trainaccel applied to `ddp` (None: no DDP model), then the report."""
        from torch.distributed.tensor import DTensor

        import trainaccel.comm

        data, module = self.data, self.module
        data["steps"] = steps
        dense = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        data["dense_bytes_per_step"] = dense
        data["elements"] = sum(p.numel() for p in module.parameters() if p.requires_grad)
        data["ddp"] = type(ddp).__name__ if ddp is not None else None
        data["params_end"] = digest(p for _, p in module.named_parameters())  # the live parameters: this replica
        sharded = any(isinstance(p, DTensor) for p in module.parameters())
        data["sharded_end"] = sharded
        # A look at the model (a full state dict on rank 0 only when sharded): under sync_every, the synced model.
        data["synced_end"] = None if sharded else digest(module.state_dict().values())
        observer = getattr(ddp, "trainaccel", None) if ddp is not None else None
        data["observer"] = observer is not None
        if observer is not None:
            data["observer_steps"] = observer.step
            data["comm"] = type(observer.comm).__name__ if observer.comm is not None else None
            data["bytes_per_step"] = trainaccel.comm.bytes_per_step(ddp)
        if ddp is not None and hasattr(ddp, "_get_ddp_logging_data"):
            try:
                data["comm_hook"] = ddp._get_ddp_logging_data().get("comm_hook") or None
            except (AttributeError, RuntimeError):  # no reducer: a sharded model
                data["comm_hook"] = None
        diloco = observer.diloco if observer is not None else getattr(optimizer, "diloco", None)
        if diloco is not None:
            data["diloco"] = {"steps": diloco.steps, "syncs": diloco.syncs, "bytes_sent": diloco.bytes_sent}
            auto = getattr(getattr(diloco, "outer", diloco), "_auto", None)  # sync_every=auto's state
            data["diloco"]["measured_by_broadcast"] = auto is not None and auto.broadcast is not None
            data["diloco"]["peak_lr"] = auto.peak_lr if auto is not None else None  # the client's optimizer read
            data["bytes_per_step"] = diloco.bytes_sent / max(diloco.steps, 1)
        if optimizer is not None and hasattr(optimizer, "_compression"):  # Horovod's DistributedOptimizer
            compression = optimizer._compression
            data["hvd_compression"] = getattr(compression, "name", getattr(compression, "__name__", str(compression)))
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"rank{data['rank']}.json").write_text(json.dumps(data))


def batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch of rank `rank` at step `step`: y = a fixed teacher's output, so the loss can fall."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(size, 8, generator=g)
    return x, teacher(x)


def teacher(x: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(12345)
    w = torch.randn(8, 4, generator=g)
    return torch.tanh(x @ w)


def dataset(world: int, size: int = 16) -> torch.utils.data.TensorDataset:
    """Every rank's STEPS batches in one data set, for the clients whose samplers split it across ranks."""
    xs = torch.cat([batch(r, s, size)[0] for s in range(1, STEPS + 1) for r in range(world)])
    return torch.utils.data.TensorDataset(xs, teacher(xs))


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
