"""A plain DDP script under `trainaccel run --on-lost-replica continue` (no sync_every) on 3 nodes x 1 worker: rank 2
is lost at step LOSE_AT and the others train on, averaging each step's gradients among themselves; each survivor
writes OUT_DIR/rank{r}.json (members, steps, its parameters, its losses, bytes sent).

How rank 2 is lost (argv[2]): `kill` (SIGKILL before its step's forward), `mid_step` (SIGKILL after step MID_AT's
exchange succeeded, before its vote: the others must redo that step's exchange without it), `freeze` (SIGSTOP: alive
but frozen, its heartbeat stopped too), `buffers` (as `kill`, the model holding a BatchNorm: DDP's broadcast of
buffers is switched off, each replica keeps its own statistics).
Usage: step_survivors.py OUT_DIR HOW
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainaccel.comm import bytes_sent, members
from trainaccel.resilience import membership

out_dir, how = sys.argv[1], sys.argv[2]
STEPS, LOSE_AT, MID_AT, LOST = 24, 9, 12, 2
dist.init_process_group("gloo")
rank = dist.get_rank()

if how == "mid_step" and rank == LOST:
    vote = membership.Membership._vote

    def dying_vote(self, name, ok, hang_s):
        if name.startswith(f"step@{MID_AT - 1}."):  # step MID_AT's exchange succeeded everywhere: die before voting
            os.kill(os.getpid(), signal.SIGKILL)
        return vote(self, name, ok, hang_s)

    membership.Membership._vote = dying_vote

torch.manual_seed(0)
layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)]
if how == "buffers":
    layers.insert(1, nn.BatchNorm1d(16))
model = DDP(nn.Sequential(*layers))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = torch.Generator().manual_seed(rank)
losses = []
for step in range(1, STEPS + 1):
    if rank == LOST and step == LOSE_AT and how in ("kill", "buffers"):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == LOST and step == LOSE_AT and how == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    x = torch.randn(16, 8, generator=data)
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
params = [p.detach().flatten().tolist() for p in model.parameters()]
result = {"members": members(model), "losses": losses, "params": params, "bytes_sent": bytes_sent(model)}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
