"""The demo's training script: plain PyTorch DDP, as a user writes it (trainaccel only measures it).

Run under torchrun (plain DDP) or `trainaccel run` (accelerated, no code change).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainaccel.comm import bytes_per_step, bytes_sent  # measurement only; the training is plain DDP

IN_FEATURES, HIDDEN, CLASSES = 256, 1024, 10


def synthetic_dataset(examples: int, seed: int = 1234) -> TensorDataset:
    """Inputs from a fixed seed, labels from a fixed random linear teacher: learnable, reproducible."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(examples, IN_FEATURES, generator=g)
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", required=True, help="rank 0 writes the measured figures here (JSON)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = synthetic_dataset(world * args.batch_size * 32)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    losses: list[float] = []
    step, epoch, started, sent_before = 0, 0, 0.0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == args.warmup:
                dist.barrier()
                started, sent_before = time.perf_counter(), bytes_sent(model)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if step == args.steps:
                break
        epoch += 1
    elapsed = torch.tensor(time.perf_counter() - started)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    tail = torch.tensor(sum(losses[-10:]) / len(losses[-10:]))
    dist.all_reduce(tail)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(replicas, flat)
    replica_diff = max(float((r - replicas[0]).abs().max()) for r in replicas)

    logging_data = model._get_ddp_logging_data()
    if rank == 0:
        result = {
            "world_size": world,
            "steps": args.steps,
            "timed_steps": args.steps - args.warmup,
            "batch_size": args.batch_size,
            "examples_per_s_per_worker": args.batch_size * (args.steps - args.warmup) / float(elapsed),
            "final_loss": float(tail) / world,
            "first_loss": losses[0],
            "bytes_per_step": bytes_per_step(model, sent_before, args.steps - args.warmup),
            "comm_hook": logging_data.get("comm_hook") or None,
            "replica_max_abs_diff": replica_diff,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
