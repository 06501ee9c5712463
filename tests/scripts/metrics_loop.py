"""A plain DDP loop with a known data wait and compute time, timing itself (no trainaccel import).

Usage: metrics_loop.py OUT_DIR STEPS; writes OUT_DIR/rank{r}.json with its own forward-to-forward times.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

DATA_S, COMPUTE_S, BATCH = 0.03, 0.02, 8

out_dir, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
forwards = []
for _step in range(steps):
    time.sleep(DATA_S)  # "loading" the batch, between the optimizer step and the forward
    forwards.append(time.perf_counter())
    loss = model(torch.randn(BATCH, 16)).pow(2).mean()
    time.sleep(COMPUTE_S)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"forwards": forwards, "failures": []}))
dist.destroy_process_group()
