"""Train one small regression task per codec on real Gloo workers; rank 0 writes the final losses.

A student MLP learns a fixed teacher plus noise, so every codec can reach the same noise floor.
Usage: convergence.py OUT_JSON STEPS
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainaccel.comm import register

IN, HIDDEN, OUT, BATCH, NOISE = 64, 64, 8, 32, 0.1
CODECS = {
    "none": dict(compression="none"),
    "fp16": dict(compression="fp16"),
    "topk": dict(compression="topk", compression_ratio=0.01),
    # Momentum correction: the codec keeps the momentum (compression_momentum), the optimizer none,
    # so what waits in the residual is not amplified again by the optimizer's momentum.
    "randomk": dict(compression="randomk", compression_ratio=0.1, compression_momentum=0.9),
    "powersgd": dict(compression="powersgd", powersgd_rank=2),
}

teacher = torch.Generator().manual_seed(1234)
W1, W2 = torch.randn(IN, HIDDEN, generator=teacher) / IN**0.5, torch.randn(HIDDEN, OUT, generator=teacher) / HIDDEN**0.5


def batch(generator: torch.Generator, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, IN, generator=generator)
    return x, torch.tanh(x @ W1) @ W2 + NOISE * torch.randn(size, OUT, generator=generator)


def student() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


dist.init_process_group("gloo")
rank = dist.get_rank()
out_path, steps = sys.argv[1], int(sys.argv[2])
x_eval, y_eval = batch(torch.Generator().manual_seed(99), 4096)
results = {}
for name, options in CODECS.items():
    model = DDP(student())
    state = register(model, compression_warmup=1, **options)
    momentum = 0.0 if options.get("compression_momentum") else 0.9
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = batch(data)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        final = nn.functional.mse_loss(model.module(x_eval), y_eval).item()
    results[name] = {"final_loss": final, "hierarchical": state.hierarchical, "bytes_per_step": state.bytes_per_step()}
if rank == 0:
    with open(out_path, "w") as f:
        json.dump(results, f)
dist.destroy_process_group()
