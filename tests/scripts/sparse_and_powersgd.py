"""Two of the engine's paths, on real Gloo workers (torchrun --nproc-per-node 3): OUT_DIR/rank{r}.json.

- Sparse gradients averaged by all-gathering indices and values (the path for backends without a sparse allreduce:
  NCCL, MPI), forced here on Gloo, equal Gloo's own sparse allreduce bit for bit, and the mean of every rank's gradient.
- PowerSGD's P and Q (its warm start) are the same bits on every rank after each step, and its error is each rank's
  own: what the checkpoint's restore assumes (P and Q from any rank's file, the error only from this rank's).
"""

import copy
import sys

import torch
import torch.distributed as dist
from checks import Checks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainaccel.comm import hooks, register

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
checks = Checks()


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(40, 3, sparse=True)
        self.head = nn.Linear(3, 2)

    def forward(self, ids):
        return self.head(self.embedding(ids)).pow(2).sum()


torch.manual_seed(0)
model = DDP(Bag())
state = register(model, compression="fp16")  # trainaccel's hook (with no codec, DDP's own allreduce would run)
backends = hooks.SPARSE_ALLREDUCE_BACKENDS


def reduced(ids: torch.Tensor, by_gather: bool) -> torch.Tensor:
    hooks.SPARSE_ALLREDUCE_BACKENDS = () if by_gather else backends
    model.zero_grad(set_to_none=True)
    model(ids).backward()
    return model.module.embedding.weight.grad


sent = {}
for step in range(4):
    # Rows repeated within a rank, shared across ranks, and a different number of rows on each rank.
    ids = torch.randint(0, 40, (3 + 5 * rank + step,), generator=torch.Generator().manual_seed(100 * step + rank))
    before = state.flat_bytes_sent
    allreduced = reduced(ids, by_gather=False)
    middle = state.flat_bytes_sent
    gathered = reduced(ids, by_gather=True)
    sent[step] = [middle - before, state.flat_bytes_sent - middle]
    checks.check(f"step {step}: sparse and coalesced", gathered.is_sparse and gathered.is_coalesced())
    checks.check(f"step {step}: the same rows", torch.equal(gathered.indices(), allreduced.indices()))
    checks.check(f"step {step}: the same values, bit for bit", torch.equal(gathered.values(), allreduced.values()))
    local = copy.deepcopy(model.module)  # this rank's own gradient, averaged by hand
    local(ids).backward()
    mean = local.embedding.weight.grad.to_dense()
    dist.all_reduce(mean)
    checks.check(f"step {step}: the mean", torch.allclose(gathered.to_dense(), mean / world, rtol=1e-6, atol=1e-7))
hooks.SPARSE_ALLREDUCE_BACKENDS = backends
checks.info["bytes"] = sent

torch.manual_seed(0)
net = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
power = register(net, compression="powersgd", compression_warmup=2).powersgd
optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
for step in range(6):
    optimizer.zero_grad()
    net(torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))).pow(2).mean().backward()
    optimizer.step()
checks.check("powersgd compressed", power.iter > power.start_powerSGD_iter and bool(power.q_memory_dict))
same = {}
for name, store in (("p", power.p_memory_dict), ("q", power.q_memory_dict), ("error", power.error_dict)):
    for index in sorted(store):  # the same buckets on every rank, in the same order
        tensor = store[index]
        everyone = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(everyone, tensor)
        same.setdefault(name, []).append(all(torch.equal(t, everyone[0]) for t in everyone))
checks.info["same_on_every_rank"] = same

checks.write(sys.argv[1], rank)
dist.destroy_process_group()
