"""A plain DDP loop in which one rank stops at a given step: it hangs, or its process dies (no trainaccel import).

Usage: stall_at_step.py hang|die STEP RANK
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

how, stall_step, stall_rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
model = DDP(nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(stall_step + 5):
    if dist.get_rank() == stall_rank and step == stall_step:
        if how == "die":
            os.kill(os.getpid(), signal.SIGKILL)  # as when its machine goes away: no error, no goodbye
        time.sleep(120)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
time.sleep(0.05)
del model
dist.destroy_process_group()
