"""Nodes of different sizes (2 + 1 workers): hierarchical=on and auto reduce flat, exactly, with one warning.

Each rank writes OUT_DIR/rank{r}.json.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel
from trainaccel.comm import comm_state

trainaccel.init(hierarchical="on", nan_check="warn")  # nan_check: keep trainaccel's own hook in the way
rank, world = dist.get_rank(), dist.get_world_size()
model = DDP(nn.Linear(100, 1, bias=False))
x = torch.full((1, 100), float(rank + 1))
model(x).sum().backward()
exact = sum(r + 1 for r in range(world)) / world
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(
        {
            "hierarchical": comm_state(model).hierarchical,
            "max_abs_err": (model.module.weight.grad - exact).abs().max().item(),
            "nodes": [list(n) for n in trainaccel.comm.discover().nodes],
        },
        f,
    )
dist.destroy_process_group()
