"""autotune=on through init(): every rank ends on the same candidate; rank 0 logs the choice once.

Run as 2 nodes x 2 workers; each rank writes OUT_DIR/rank{r}.json, with the process groups it holds after the
registration and at the end. With argv[2] `flat` rank 0 chooses the flat candidate whatever the timings.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel
from trainaccel.comm import autotune, comm_state

if sys.argv[2:] == ["flat"]:
    autotune.choose = lambda times: "fp16 flat"  # rank 0's choice, broadcast: the hierarchy's groups go
trainaccel.init(autotune="on", compression="fp16")
rank = dist.get_rank()


def groups_held() -> int:
    return sum(1 for g in distributed_c10d._world.pg_map if isinstance(g, dist.ProcessGroup))


torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)), bucket_cap_mb=0.25)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
labels_seen, held = [], []
for _step in range(60):
    x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    labels_seen.append(comm_state(model).current.label)
    if _step == 0:
        held.append(groups_held())
held.append(groups_held())
tuner = comm_state(model)
# After the choice, parameters are still identical on every rank.
digest = torch.cat([p.detach().flatten() for p in model.parameters()]).sum().item()
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(
        {
            "chosen": tuner.chosen.label if tuner.chosen else None,
            "candidates": [c.label for c in tuner.candidates],
            "timed": {k: len(v) for k, v in tuner.times.items()},
            "labels_seen": labels_seen,
            "digest": digest,
            "held": held,
        },
        f,
    )
dist.destroy_process_group()
