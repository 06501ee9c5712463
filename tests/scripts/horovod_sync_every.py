"""hvd.DistributedOptimizer(..., sync_every=H) on real workers: no gradient exchange, DiLoCo's outer step every H
steps, equal to DiLoCo computed by hand (every rank replays all replicas). Each rank writes OUT_DIR/rank{r}.json."""

import copy
import hashlib
import sys

import torch
from checks import Checks, broadcasts_counted
from torch import nn

import trainaccel.horovod as hvd

H, STEPS = 2, 5
hvd.init()
rank, world = hvd.rank(), hvd.size()
checks = Checks()


def batch(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * r + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, r: int, step: int) -> None:
    x, y = batch(r, step)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


torch.manual_seed(rank)  # different starts: broadcast_parameters makes them rank 0's
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
optimizer = hvd.DistributedOptimizer(
    torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters(), sync_every=H
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
start = copy.deepcopy(model)
with broadcasts_counted() as carried:  # what the steps broadcast
    for step in range(1, STEPS + 1):
        train(model, optimizer, rank, step)
elements, largest = sum(p.numel() for p in model.parameters()), max(carried, default=0)
checks.check(f"the first step did not send the model again ({largest} of {elements})", largest < elements)
grad = model[0].weight.grad.clone()
optimizer.diloco.sync()  # the documented look: step 5 is not a sync
checks.check("two outer steps", optimizer.diloco.syncs == 2 and optimizer.diloco.steps == STEPS)

# By hand: `world` replicas from rank 0's start, inner Adam, their mean every H (the default outer rule) and at the end.
replicas = [copy.deepcopy(start) for _ in range(world)]
inners = [torch.optim.Adam(m.parameters(), lr=0.01) for m in replicas]
for step in range(1, STEPS + 1):
    for r, (m, opt) in enumerate(zip(replicas, inners)):
        train(m, opt, r, step)
    if step % H == 0 or step == STEPS:
        with torch.no_grad():
            for ps in zip(*(m.parameters() for m in replicas)):
                mean = sum(p / world for p in ps)
                for p in ps:
                    p.copy_(mean)
expected = [p.detach() for p in replicas[0].parameters()]
err = max(float((p - e).abs().max()) for p, e in zip(model.parameters(), expected))
checks.check(f"equals DiLoCo by hand (max error {err:.2e})", err <= 1e-6)
checks.info["grad"] = grad.sum().item()  # this rank's own gradient: nothing exchanged

# Changed on one rank after broadcast_parameters: the first step sends rank 0's parameters, and the replicas start
# (hence stay) equal at the syncs.
other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
tuned = hvd.DistributedOptimizer(
    torch.optim.Adam(other.parameters(), lr=0.01), named_parameters=other.named_parameters(), sync_every=H
)
hvd.broadcast_parameters(other.state_dict(), root_rank=0)
if rank == 1:
    with torch.no_grad():
        other[0].weight.add_(1.0)
with broadcasts_counted() as carried:
    for step in range(1, H + 1):  # one sync
        train(other, tuned, rank, step)
checks.check(
    "a parameter changed after broadcast_parameters: the first step sends the model",
    max(carried, default=0) >= elements,
)
synced = torch.cat([p.detach().reshape(-1) for p in other.parameters()])  # right after the sync: the synced model
checks.info["after_sync"] = hashlib.sha256(synced.numpy().tobytes()).hexdigest()
checks.raises(
    "compression with sync_every",
    lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), compression=hvd.Compression.fp16, sync_every=2
    ),
    ValueError,
    "sync_every replaces the per-step gradient exchange",
)
checks.write(sys.argv[1], rank)
hvd.shutdown()
