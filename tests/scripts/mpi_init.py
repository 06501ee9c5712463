"""One-line path under an MPI-style start: DDP imported first, then trainaccel.init()."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # imported before init(): still patched

import trainaccel

trainaccel.init()
assert dist.is_initialized(), "init() did not start the process group"
rank, world = dist.get_rank(), dist.get_world_size()
summed = torch.tensor([float(rank + 1)])
dist.all_reduce(summed)

model = DDP(nn.Linear(8, 2))
model(torch.randn(4, 8)).sum().backward()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(
        {
            "rank": rank,
            "world_size": world,
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
            "allreduce_sum": summed.item(),
            "comm_hook": model._get_ddp_logging_data().get("comm_hook"),
            "trainaccel": getattr(getattr(model, "trainaccel", None), "comm", None) is not None,
            "backend": dist.get_backend(),
        },
        f,
    )
dist.destroy_process_group()
