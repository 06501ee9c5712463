"""LocalSteps on real Gloo workers: 8 passes with every=4 equal 2 large-batch SGD steps, 2 reductions.

Run with torchrun --nproc-per-node 2; each rank writes OUT_DIR/rank{r}.json.
"""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel
from trainaccel.comm import LocalSteps, register

EVERY, PASSES, LR = 4, 8, 0.1


def batch(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
net = nn.Linear(8, 4)
reference = copy.deepcopy(net)
model = DDP(net)
state = register(model, nan_check="warn")  # trainaccel's own hook (not DDP's builtin): it counts reductions
# Two optimizers (the weight's and the bias's), as a script with a sparse embedding has: both step every EVERY passes.
optimizers = [torch.optim.SGD([net.weight], lr=LR), torch.optim.SGD([net.bias], lr=LR)]
steps = LocalSteps(model, optimizers, every=EVERY)
syncing = []
for i in range(PASSES):
    syncing.append(steps.syncing)
    with steps:
        nn.functional.mse_loss(model(batch(rank, i)[0]), batch(rank, i)[1]).backward()

# The same two steps computed here alone: gradient averaged over all ranks and the 4 passes.
for step in range(PASSES // EVERY):
    reference.zero_grad()
    for r in range(world):
        for i in range(step * EVERY, (step + 1) * EVERY):
            x, y = batch(r, i)
            (nn.functional.mse_loss(reference(x), y) / (world * EVERY)).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= LR * p.grad

# Zero-code mode cannot accumulate: a model built after init(local_steps=2) without LocalSteps
# still trains (reducing at every pass) and rank 0 says so once.
trainaccel.init(local_steps=2)
plain = DDP(nn.Linear(8, 4))
for i in range(2):
    nn.functional.mse_loss(plain(batch(rank, i)[0]), batch(rank, i)[1]).backward()

error = max((a - b).abs().max().item() for a, b in zip(net.parameters(), reference.parameters()))
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(
        {
            "max_abs_err": error,
            "hook_steps": state.reductions,
            "syncing": syncing,
            "grads_cleared": all(p.grad is None for p in net.parameters()),
        },
        f,
    )
dist.destroy_process_group()
