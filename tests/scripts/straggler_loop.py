"""A plain DDP loop in which one rank takes 50% longer per step (no trainaccel import).

Usage: straggler_loop.py STEPS SLOW_RANK
"""

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

BASE_S = 0.15  # every rank's "data loading" per step; the slow rank's is 1.5 times that

steps, slow_rank = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
# DDP's first bucket closes past 1 MiB (at the middle layer): the timeline shows two buckets.
model = DDP(nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _step in range(steps):
    time.sleep(BASE_S * (1.5 if rank == slow_rank else 1.0))
    loss = model(torch.randn(8, 64)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
time.sleep(0.05)  # Gloo's threads release their callbacks before the group goes
del model
dist.destroy_process_group()
