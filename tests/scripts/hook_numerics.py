"""trainaccel's hook on real Gloo groups: exactness per codec, bytes, NaN checks, hook precedence.

Run with torchrun --nproc-per-node 2; each rank writes its findings to OUT_DIR/rank{r}.json.
"""

import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from weights import Weights

import trainaccel
from trainaccel.comm import comm_state, register

N = 1000


def inputs(rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(10 + rank)) * 3


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
exact = sum(inputs(r) for r in range(world)) / world
found = {"rank": rank}

for codec in ("none", "fp16", "bf16"):
    model = DDP(Weights(N))
    state = register(model, compression=codec, compression_warmup=1)
    model(torch.zeros_like(inputs(rank))).backward()  # a lossy codec starts after DDP's first step, exactly reduced
    model.zero_grad()
    before = 0 if state.builtin else state.bytes_sent
    model(inputs(rank)).backward()
    err = (model.module.weight.grad - exact).abs().max().item()
    sent = state.bytes_per_step() if state.builtin else state.bytes_sent - before
    found[codec] = {
        "max_abs_err": err,
        "bytes_per_step": sent,
        "steps": state.reductions,
        "hook": model._get_ddp_logging_data().get("comm_hook"),
    }

# nan_check=raise: a non-finite gradient on one rank fails the step on every rank, naming the parameter.
model = DDP(Weights(N))
register(model, nan_check="raise")
x = inputs(rank)
if rank == 1:
    x[7] = float("inf")
try:
    model(x).backward()
    found["raise"] = None
except Exception as e:  # surfaces from DDP's reducer as RuntimeError carrying our message
    found["raise"] = f"{type(e).__name__}: {e}"

# nan_check=warn: logs the parameter, training goes on.
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("trainaccel").addHandler(handler)
model = DDP(Weights(N))
register(model, nan_check="warn")
model(x).backward()
found["warn"] = [r.getMessage() for r in records]
found["warn_grad_finite"] = bool(torch.isfinite(model.module.weight.grad).all())

# After init(), DDP models get the hook at first forward, unless the script registers its own.
trainaccel.init(start_process_group=False, compression="fp16")
auto = DDP(Weights(N))
auto(inputs(rank)).backward()
own = DDP(Weights(N))
own.register_comm_hook(None, default_hooks.allreduce_hook)
own(inputs(rank)).backward()
trainaccel.shutdown()
plain = DDP(Weights(N))
plain(inputs(rank)).backward()
found["hooks"] = {
    "auto": [auto._get_ddp_logging_data().get("comm_hook"), comm_state(auto).codec.name],
    "own": [own._get_ddp_logging_data().get("comm_hook"), comm_state(own) is None],
    "plain": [plain._get_ddp_logging_data().get("comm_hook"), comm_state(plain) is None],
}


class SparseFirst(nn.Module):
    """A sparse embedding registered first: DDP puts its gradient in the last bucket, the one PowerSGD counts at."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 16)
        self.unused = nn.Linear(4, 4)

    def forward(self, ids):
        return self.head(self.embedding(ids)).pow(2).mean()


# powersgd beside a sparse gradient: the dense buckets are compressed from its start step on, whichever bucket is last.
torch.manual_seed(0)
model = DDP(SparseFirst(), find_unused_parameters=True)
state = register(model, compression="powersgd", compression_warmup=2)
for step in range(4):
    model(torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(step * 2 + rank))).backward()
    model.zero_grad()
found["powersgd_sparse"] = {"iter": state.powersgd.iter, "start": state.powersgd.start_powerSGD_iter}

with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(found, f)
dist.destroy_process_group()
