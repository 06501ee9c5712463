"""autotune=on through init(): every rank ends on the same candidate; rank 0 logs the choice once.

Run as 2 nodes x 2 workers; each rank writes OUT_DIR/rank{r}.json.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel
from trainaccel.comm import comm_state

trainaccel.init(autotune="on", compression="fp16")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)), bucket_cap_mb=0.25)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
labels_seen = []
for _step in range(60):
    x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    labels_seen.append(comm_state(model).current.label)
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
        },
        f,
    )
dist.destroy_process_group()
