"""A plain DDP script with no trainaccel import: AdamW, a checkpoint saved or loaded, the parameters read after.

Argv: OUT_DIR [--steps N] [--save PATH] [--load PATH] [--optimizer-first] [--rank0-save] [--unused] [--sgd]. Each rank
trains on
its own batches; rank 0 saves `model.state_dict()` after training (computed on every rank), or with --rank0-save at
the third step on rank 0 alone (the DDP habit that sharding cannot serve). Writes per rank its losses and its parameters, read after
destroy_process_group().
"""

import argparse
import functools
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("out_dir", type=Path)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--save")
parser.add_argument("--load")
parser.add_argument("--optimizer-first", action="store_true", help="build the optimizer before wrapping the model")
parser.add_argument("--rank0-save", action="store_true")
parser.add_argument("--unused", action="store_true", help="a head that only rank 0 uses (find_unused_parameters)")
parser.add_argument("--sgd", action="store_true", help="plain SGD instead of AdamW")
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        self.extra = nn.Linear(4, 4)

    def forward(self, x, use_extra):
        y = self.body(x)
        return y + self.extra(y) if use_extra else y


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)  # replicas start from different values: DDP starts them all from rank 0's
model = Net() if args.unused else nn.Sequential(*Net().body)
Optimizer = functools.partial(torch.optim.SGD, lr=0.05) if args.sgd else functools.partial(torch.optim.AdamW, lr=1e-2)
if args.optimizer_first:
    optimizer = Optimizer(model.parameters())
ddp = DDP(model, find_unused_parameters=args.unused)
if not args.optimizer_first:
    optimizer = Optimizer(ddp.parameters())
if args.load:
    ddp.load_state_dict(torch.load(args.load))
generator = torch.Generator().manual_seed(100 + rank)
losses = []
for step in range(args.steps):
    x, y = torch.randn(8, 32, generator=generator), torch.randn(8, 4, generator=generator)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(ddp(x, rank == 0) if args.unused else ddp(x), y)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if args.rank0_save and step == 2 and rank == 0:  # the DDP habit: a checkpoint in the loop, by rank 0 alone
        torch.save(ddp.state_dict(), args.save)
if args.save and not args.rank0_save:
    state = ddp.state_dict()
    if rank == 0:
        torch.save(state, args.save)
    dist.barrier()
kind = type(ddp).__name__
mesh = getattr(next(ddp.parameters()), "device_mesh", None)  # a sharded parameter's mesh (a DTensor's)
# As DDP scripts end on torch 2.13's CPU Gloo (else a worker can abort at exit): the last collectives
# finished, the DDP model dropped, a moment for Gloo's threads, then the group.
dist.barrier()
del ddp, optimizer
time.sleep(0.05)
dist.destroy_process_group()
params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
result = {
    "losses": losses,
    "params": params.tolist(),
    "kind": kind,
    "param_type": type(next(model.parameters())).__name__,
    "mesh": None if mesh is None else list(mesh.shape),
}
(args.out_dir / f"rank{rank}.json").write_text(json.dumps(result))
