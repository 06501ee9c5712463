"""One arm of `trainaccel bench train`: a DDP training loop on synthetic data, timed after warm-up.

Arms: baseline (plain DDP under torchrun), torch-bf16 and torch-fp16 (DDP with torch's own
`bf16_compress_hook` / `fp16_compress_hook`: the strongest baseline that needs no trainaccel),
trainaccel (the same script, under `trainaccel run`), local (no gradient exchange: DDP whose hook
communicates nothing, the compute-only ceiling), node-local (gradients averaged within each node only, never across:
the ceiling of one replica per node, its in-node exchange included).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.

import argparse
import json
import logging
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from trainaccel.amp import scaled
from trainaccel.bench.models import get_model
from trainaccel.comm import bytes_per_step, bytes_sent
from trainaccel.compiler import is_compiled
from trainaccel.context import current_config
from trainaccel.monitor.metrics import peak_memory_bytes
from trainaccel.sharding import ShardedDataParallel

ARMS = ("baseline", "torch-bf16", "torch-fp16", "trainaccel", "local", "node-local")
CEILINGS = ("local", "node-local")  # no exchange across nodes: what the others' time is a share of
TORCH_HOOKS = {"torch-bf16": default_hooks.bf16_compress_hook, "torch-fp16": default_hooks.fp16_compress_hook}


class AutoLines(logging.Handler):
    """Keeps trainaccel's log lines that start with `sync_every=auto:` (its choices), for a worker's result."""

    PREFIX = "sync_every=auto:"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.PREFIX):
            self.lines.append(message)


def auto_lines(config: object) -> AutoLines:
    """A handler keeping sync_every=auto's choices under `config` (trainaccel's resolved configuration), whatever
    log_level says; it keeps none where sync_every is not auto."""
    said = AutoLines()
    if config is not None and getattr(config, "sync_every", None) == "auto":
        trainaccel_log = logging.getLogger("trainaccel")
        trainaccel_log.addHandler(said)
        if not trainaccel_log.isEnabledFor(logging.INFO):
            trainaccel_log.setLevel(logging.INFO)
    return said


def cuda_available() -> bool:
    """Whether workers will run on GPUs (torch's bf16 hook refuses to run without CUDA and NCCL)."""
    return torch.cuda.is_available()


def no_communication(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP hook that keeps each worker's own gradients: training with the network taken out."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def set_up_arm(model: DistributedDataParallel, arm: str) -> None:
    """Give the model the arm's communication hook: none, nothing (local), or torch's own bf16/fp16 one."""
    if arm == "local":
        model.register_comm_hook(None, no_communication)
        model.broadcast_buffers = False  # no exchange at all: a buffer broadcast per step is a barrier over the link
    elif arm == "node-local":
        model.register_comm_hook(node_group(), default_hooks.allreduce_hook)  # torch's own, over the node's workers
        model.broadcast_buffers = False  # (over the default group: across nodes)
    elif arm in TORCH_HOOKS:
        model.register_comm_hook(None, TORCH_HOOKS[arm])


def node_group() -> dist.ProcessGroup:
    """This worker's node's workers (torchrun gives a node consecutive ranks); every rank builds every node's."""
    per_node, world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), dist.get_world_size()
    groups = [dist.new_group(list(range(first, first + per_node))) for first in range(0, world, per_node)]
    return groups[dist.get_rank() // per_node]


def sent_per_step(model: DistributedDataParallel, arm: str, sent_before: int, steps: int) -> float | None:
    """Bytes each worker sent per step across nodes: nothing (local, node-local), half of every gradient (torch's
    hooks), or as measured; None for a sharded model, whose gathers and reduce-scatters FSDP2 issues uncounted."""
    if arm in CEILINGS:
        return 0.0
    if isinstance(model, ShardedDataParallel):
        return None
    if arm in TORCH_HOOKS:
        return float(sum(p.numel() * 2 for p in model.parameters() if p.requires_grad))
    return bytes_per_step(model, sent_before, steps)


def comm_hook(model: DistributedDataParallel) -> str | None:
    """The DDP model's communication hook by name, or `shard=MODE` for a sharded one."""
    if isinstance(model, ShardedDataParallel):
        return f"shard={model.shard_mode}"
    return model._get_ddp_logging_data().get("comm_hook") or None


def start_process_group() -> torch.device:
    """Join the job: NCCL on this worker's GPU when there is one, else Gloo on the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def arm_arguments(arms: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options every bench worker takes from `trainaccel bench train`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--arm", choices=arms, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--out", required=True)
    return parser


def timed_steps(
    step: Callable[[int], torch.Tensor], steps: int, warmup: int, device: torch.device, on_start: Callable[[], None]
) -> tuple[float, torch.Tensor]:
    """Run `step(i)` for each step; returns the slowest worker's seconds after `warmup` steps, and the last loss."""
    started = 0.0
    for i in range(steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            started = time.perf_counter()
            on_start()
        loss = step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor(time.perf_counter() - started, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest worker sets the pace
    return float(elapsed), loss


def job_peak_memory(device: torch.device, since: int = 0) -> int:
    """The largest peak memory over the workers (less `since`, each worker's own reading before the model)."""
    peak = torch.tensor(float(peak_memory_bytes(device) - since), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def main() -> None:
    parser = arm_arguments(ARMS)
    parser.add_argument("--image-size", type=int, required=True)
    args = parser.parse_args()

    device = start_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = get_model(args.model)
    torch.manual_seed(0)
    before_model = peak_memory_bytes(device)  # the process's own memory: the model's comes on top
    model = DistributedDataParallel(
        spec.build().to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    set_up_arm(model, args.arm)
    said = auto_lines(current_config())
    optimizer = scaled(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))  # loss scaling if amp=fp16
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, *spec.example_shape(args.image_size), generator=g).to(device)
    y = torch.randint(0, spec.num_classes, (args.batch_size,), generator=g).to(device)

    def step(_: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    sent_before = 0

    def on_start() -> None:
        nonlocal sent_before
        sent_before = bytes_sent(model)

    elapsed, loss = timed_steps(step, args.steps, args.warmup, device, on_start)
    peak = job_peak_memory(device)
    model_peak = job_peak_memory(device, since=before_model)

    if rank == 0:
        timed = args.steps - args.warmup
        amp = getattr(getattr(model, "trainaccel", None), "amp", None)
        result = {
            "arm": args.arm,
            "world_size": world,
            "examples_per_s_per_worker": args.batch_size * timed / elapsed,
            "step_time_s": elapsed / timed,
            "bytes_per_step": sent_per_step(model, args.arm, sent_before, timed),
            "peak_memory_bytes": peak,
            "model_memory_bytes": model_peak,
            "comm_hook": comm_hook(model),
            "parameters": sum(p.numel() for p in model.parameters()),
            "final_loss": loss.item(),
            "amp": str(amp.dtype).removeprefix("torch.") if amp is not None else None,
            "compiled": is_compiled(model),
            "auto_settings": said.lines,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    model = optimizer = None  # drops them (and the closures' references) before the group goes
    release_process_group()


def release_process_group() -> None:
    """Leave the job; drop the DDP model first, so that its reducer does not outlive the group."""
    # Gloo's thread frees the last collective's work after it completes, and that takes the GIL;
    # destroying the group (here, or by the DDP model's reducer on return) holds the GIL and waits
    # for that thread's lock. Releasing the GIL first avoids the deadlock (torch 2.13, Gloo).
    time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
