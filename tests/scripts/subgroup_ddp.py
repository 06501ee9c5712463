"""DDP over data-parallel subgroups ({0, 2} and {1, 3}, as a 2-way tensor-parallel job has) with fp16 compression.

Each rank records every process group it builds after the script's own (torch.distributed.new_group's ranks and
use_local_synchronization) and writes OUT_DIR/rank{r}.json with them and a digest of its parameters. A default group
bound to a device (NCCL with device_id) splits every new group from its own communicator, which every rank of the job
must join in the same order: the record shows whether they would. With TEST_DEVICE=cuda each worker trains on its
own GPU over NCCL, and with BIND_DEVICE=1 the default group is bound to it (device_id): then the groups are split
from the default communicator, and would hang if built by their members alone (tests/gpu/test_cuda_many_gpus.py).
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel

CUDA = os.environ.get("TEST_DEVICE") == "cuda"
DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if CUDA else torch.device("cpu")
if CUDA:
    torch.cuda.set_device(DEVICE)
    bound = {"device_id": DEVICE} if os.environ.get("BIND_DEVICE") == "1" else {}
    dist.init_process_group("nccl", **bound)
else:
    dist.init_process_group("gloo")
rank = dist.get_rank()
mine = [r for r in range(dist.get_world_size()) if r % 2 == rank % 2]
groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
built: list = []
new_group = dist.new_group


def recording(ranks=None, *args, **kwargs):
    built.append([list(ranks or []), bool(kwargs.get("use_local_synchronization", False))])
    return new_group(ranks, *args, **kwargs)


dist.new_group = recording
trainaccel.init(compression="fp16")
torch.manual_seed(rank % 2)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).to(DEVICE), process_group=groups[rank % 2])
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
for _ in range(5):
    loss = model(torch.randn(4, 8, generator=g).to(DEVICE)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"built": built, "digest": digest, "members": mine}, f)
trainaccel.shutdown()
dist.destroy_process_group()
