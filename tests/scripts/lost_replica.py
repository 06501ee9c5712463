"""DiLoCo under on_lost_replica=continue on 3 nodes x 1 worker: rank 2 is lost at inner step LOSE_AT, the others
train on; each survivor writes OUT_DIR/rank{r}.json (members, syncs, its parameters, its losses, its scope).

How rank 2 is lost (argv[2]): `kill` (SIGKILL between syncs), `error` (an exception: its launcher ends it),
`freeze` (SIGSTOP: alive but frozen, its heartbeat stopped too), `mid_sync` (SIGKILL after the third sync's exchange,
before its vote: the others must redo that sync without it), `auto` (SIGKILL, under sync_every=auto), `zero_code`
(SIGKILL; a plain DDP script, run with `trainaccel run --sync-every 4 --on-lost-replica continue`), `first` (as
`zero_code`, rank 0 killed: it writes OUT_DIR/lost first, and the test ends the rest of its node), `first_rejoin`
(as `first`, then as `rejoin`: node 0 started again rejoins), `store_lost`
(as `zero_code`, nobody lost: a step takes 0.3 s, and at step 5 rank 0 writes OUT_DIR/lost for the test to kill a
majority of the store's members), `node` (as
`zero_code` on 3 nodes x 2 workers, sync_scope=node: rank 4 is killed, and node 2's other worker, rank 5, is lost
with it: their node is one replica), `node_freeze` (as `node`, rank 4 frozen by SIGSTOP), `rejoin` (SIGKILL, then the
test starts node 2 again: that start rejoins, takes the model at the next sync and trains to the end; the others wait
at step 40 until it has asked to join, so that they are still training when it comes), `agent` (as `rejoin`, but node
2's own `trainaccel run --max-restarts 1` starts its worker again), `node_rejoin` (as `rejoin` under node scope: node
2's two workers, ranks 4 and 5, rejoin together; the others wait at step 40 for both), `node_agent` (as
`node_rejoin`, node 2's workers started again by its own `trainaccel run --max-restarts 1`), `grow` (as `rejoin`, in
a job of 3 nodes that may grow to 4, `--nnodes 3:4`: nobody is lost, rank 0 writes OUT_DIR/grow at step 9 for the
test to start node 3, whose worker joins as a rank started again does), `node_grow` (as `grow` under node scope: 2
nodes x 2 workers of `--nnodes 2:3`, node 2's workers, ranks 4 and 5, join together), `horovod` (as
`zero_code`, the script written for the Horovod API: hvd.DistributedOptimizer takes the launch's options; its
hvd.allreduce of a loss at step 2 is refused). Under node scope each worker
also writes its live parameters after step 46, between two syncs: a node's workers hold the same ones. In the rejoin
cases the optimizer keeps momentum: rank 0 writes its momentum after step 40 (the join's), a rejoined rank its
momentum before its first step (taken from rank 0's, the lowest live replica). Each worker passes over a job-wide
DistributedSampler of SAMPLES indices before training and after it. With LOST_REPLICA_DEVICE=cuda the model, its
data and so the anchors and the outer state live on the GPU (every worker on GPU 0, over Gloo: tests/gpu).
Usage: lost_replica.py OUT_DIR HOW
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
from torch.utils.data.distributed import DistributedSampler

from trainaccel.comm import DiLoCo, members, rejoined_at, sync_replicas
from trainaccel.observer import observer_of
from trainaccel.resilience import failfast, membership

out_dir, how = sys.argv[1], sys.argv[2]
GROWS = how in ("grow", "node_grow")  # a node joins a job that started without it
REJOINS = how in ("rejoin", "agent", "node_rejoin", "node_agent", "first_rejoin") or GROWS
STEPS, EVERY, LOSE_AT = (48 if REJOINS or how == "store_lost" else 24), 4, 9
NODE_SCOPE = how in ("node", "node_freeze", "node_rejoin", "node_agent", "node_grow")
LOST = 4 if NODE_SCOPE else 0 if how in ("first", "first_rejoin") else 2
STARTED_AGAIN = (4, 5) if NODE_SCOPE else (3,) if how == "grow" else (LOST,)  # the ranks of the node lost (or new)
SAMPLES = 60
DEVICE = torch.device(os.environ.get("LOST_REPLICA_DEVICE", "cpu"))
if DEVICE.type == "cuda":
    torch.cuda.set_device(0)  # NCCL refuses two ranks on one GPU; the group is Gloo, which takes CUDA tensors
if how == "horovod":
    import trainaccel.horovod as hvd

    hvd.init()
else:
    dist.init_process_group("gloo")
rank = dist.get_rank()

if how == "mid_sync" and rank == 2:
    vote = membership.Membership._vote

    def dying_vote(self, name, ok, hang_s):
        if name.startswith("diloco/0@12."):  # the third sync (step 12), after its exchange succeeded everywhere
            os.kill(os.getpid(), signal.SIGKILL)
        return vote(self, name, ok, hang_s)

    membership.Membership._vote = dying_vote

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(DEVICE)
MOMENTUM = 0.9 if REJOINS else 0.0
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=MOMENTUM)
if (
    how in ("zero_code", "first", "first_rejoin", "store_lost") or GROWS or NODE_SCOPE
):  # DDP as the script has it; trainaccel's options make it DiLoCo
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=MOMENTUM)
elif how == "horovod":  # the launch's sync_every and on_lost_replica, taken by hvd.DistributedOptimizer
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    diloco = optimizer.diloco
else:
    diloco = DiLoCo(model, optimizer, sync_every="auto" if how == "auto" else EVERY, on_lost_replica="continue")
data = torch.Generator().manual_seed(rank)
# A job-wide sampler as a script builds it; one pass before training and one after (trainaccel splits it over the
# workers present at each pass: `split` holds what this worker drew in each).
sampler = DistributedSampler(list(range(SAMPLES)), shuffle=False)
split = {"before": list(sampler)}
losses, live, momentum, refused = [], None, {}, None


def momentum_now() -> list[float] | None:
    buffers = [optimizer.state[p].get("momentum_buffer") for p in model.parameters()]
    return None if any(b is None for b in buffers) else torch.cat([b.flatten() for b in buffers]).tolist()


start = rejoined_at(model)  # 0, or for node 2's second start the step it rejoined at
if start:  # before its first step, after trainaccel's own hook (torch runs the global step hooks first)

    def first_step(*_) -> None:
        momentum.setdefault("at_join", momentum_now())

    optimizer.register_step_pre_hook(first_step)
for step in range(start + 1, STEPS + 1):
    if REJOINS and rank not in STARTED_AGAIN and step == 40:
        store, waited = failfast.root_store(distributed_c10d._get_default_store()), time.monotonic()
        asked = [f"{failfast.job_prefix()}members/join/{r}" for r in STARTED_AGAIN]
        while not store.check(asked) and time.monotonic() - waited < 60:
            time.sleep(0.1)
    if (
        rank == LOST
        and step == LOSE_AT
        and how
        in (
            *("kill", "first", "first_rejoin", "auto", "zero_code", "horovod"),
            *("node", "node_rejoin", "node_agent", "rejoin", "agent"),
        )
    ):
        if how in ("first", "first_rejoin"):  # the test then ends the rest of its node (launcher, store member)
            open(os.path.join(out_dir, "lost"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if GROWS and rank == 0 and step == LOSE_AT:
        open(os.path.join(out_dir, "grow"), "w").close()
    if how == "store_lost":
        time.sleep(0.3)
        if rank == 0 and step == 5:
            open(os.path.join(out_dir, "lost"), "w").close()
    if rank == LOST and step == LOSE_AT and how in ("freeze", "node_freeze"):
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 2 and step == LOSE_AT and how == "error":
        raise RuntimeError("rank 2 failed on purpose")
    x = torch.randn(16, 8, generator=data).to(DEVICE)
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if how == "horovod" and step == 2:  # the script's metric average in training, before any loss: refused
        try:
            hvd.allreduce(loss.detach(), name="loss")
        except RuntimeError as e:
            refused = str(e)
    if step == 46:
        live = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    if REJOINS and rank == min(set(range(dist.get_world_size())) - set(STARTED_AGAIN)) and step == 40:
        momentum["at_join"] = momentum_now()  # what it sends at this round's end
if how == "horovod":
    diloco.sync()  # the replicas' mean now (nothing to do where step 24 was a sync)
else:
    sync_replicas(model)
if how == "kill" or REJOINS:  # the script's own collective on the default group, which holds the lost rank
    try:
        dist.barrier()
    except RuntimeError as e:
        refused = str(e)
split["after"] = list(sampler)
params = torch.cat([p.detach().flatten() for p in model.parameters()])
if how in ("zero_code", "first", "first_rejoin", "store_lost") or GROWS or NODE_SCOPE:
    diloco = observer_of(model).diloco
present = diloco.members if how == "horovod" else members(model)  # (the public form, for a script's own use)
if how != "horovod":  # (hvd.shutdown() destroys it at exit)
    dist.destroy_process_group()  # after a loss: the groups holding the lost process are aborted, not shut down
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    result = {"members": present, "syncs": diloco.syncs, "params": params.tolist(), "losses": losses}
    result["scope"] = diloco.outer.scope
    # what crossed to this worker per sync, against the model's float32 bytes (flat: all of it; two levels: a shard)
    result["sent_per_sync"] = diloco.bytes_sent / max(1, diloco.syncs)
    result["model_bytes"] = 4 * sum(p.numel() for p in model.parameters())
    result["live"], result["momentum_at_join"] = live, momentum.get("at_join")
    json.dump({**result, "rejoined_at": start, "refused": refused, "split": split}, f)
