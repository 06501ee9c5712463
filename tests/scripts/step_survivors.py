"""A plain DDP script under `trainaccel run --on-lost-replica continue` (no sync_every) on 3 nodes x 1 worker: rank 2
is lost at step LOSE_AT and the others train on, averaging each step's gradients among themselves; each survivor
writes OUT_DIR/rank{r}.json (members, steps, its parameters, its losses, bytes sent).

How rank 2 is lost (argv[2]): `kill` (SIGKILL before its step's forward), `mid_step` (SIGKILL after step MID_AT's
exchange succeeded, before its vote: the others must redo that step's exchange without it), `freeze` (SIGSTOP: alive
but frozen, its heartbeat stopped too), `buffers` (as `kill`, the model holding a BatchNorm: DDP's broadcast of
buffers is switched off, each replica keeps its own statistics), `rejoin` (as `kill`, then the test starts node 2
again: that start rejoins at the start of a step's exchange, takes the members' parameters and its optimizer's
momentum, and trains to the end with them; the others wait at step 40 until it has asked to join, so that they are
still training when it comes; rank 2 writes its result too, with the step it rejoined at).
Usage: step_survivors.py OUT_DIR HOW
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.nn.parallel import DistributedDataParallel as DDP

from trainaccel.comm import bytes_sent, members, rejoined_at
from trainaccel.resilience import failfast, membership

out_dir, how = sys.argv[1], sys.argv[2]
STEPS, LOSE_AT, MID_AT, LOST = (48 if how == "rejoin" else 24), 9, 12, 2
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
start = rejoined_at(model)  # 0, or for rank 2's second start the steps the others had taken when it rejoined
for step in range(start + 1, STEPS + 1):
    if how == "rejoin" and rank != LOST and step == 40:
        store, waited = failfast.root_store(distributed_c10d._get_default_store()), time.monotonic()
        while not store.check([f"{failfast.job_prefix()}members/join/{LOST}"]) and time.monotonic() - waited < 60:
            time.sleep(0.1)
    if rank == LOST and step == LOSE_AT and how in ("kill", "buffers", "rejoin") and not start:
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
result["rejoined_at"], result["momentum"] = (
    start,
    [optimizer.state[p]["momentum_buffer"].sum().item() for p in model.parameters()],
)
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
