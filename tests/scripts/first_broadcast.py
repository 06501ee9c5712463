"""A plain DDP script under `sync_every=3`: what the first inner step broadcasts, and that the replicas start equal.

Usage: first_broadcast.py OUT_DIR CASE...; each case trains a model of its own, in turn. Each rank writes
OUT_DIR/rank{r}.json: by case, the elements `dist.broadcast` carried during its training and the synced model's digest.
A case is how the script leaves its parameters between DDP's wrap and the first step:

- unchanged: as DDP's broadcast left them (the common script)
- in_place: rank 1 adds 1 to a weight under no_grad (a load_state_dict or nn.init on some ranks does the same)
- replaced: rank 1 assigns a new tensor to a weight's `.data`
- no_init_sync: each rank's own initial model, wrapped with DDP(init_sync=False)
- ignored: the last layer's weight, different on each rank, is one DDP ignores (so does not broadcast)
- in_place_rank0: rank 0 alone changes a weight in place (rank 1's own are unchanged: the ranks must agree)
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from checks import broadcasts_counted
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(case: str, rank: int) -> dict:
    torch.manual_seed(rank if case in ("no_init_sync", "ignored") else 0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    if case == "ignored":
        model._ddp_params_and_buffers_to_ignore = ["2.weight"]
    ddp = DDP(model, init_sync=case != "no_init_sync")
    weight = model[0].weight
    if (case == "in_place" and rank == 1) or (case == "in_place_rank0" and rank == 0):
        with torch.no_grad():
            weight.add_(1.0)
    if case == "replaced" and rank == 1:
        weight.data = weight.data + 1.0
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    with broadcasts_counted() as carried:
        for step in range(1, 7):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
    return {
        "carried": carried,
        "elements": sum(p.numel() for p in model.parameters()),
        "syncs": ddp.trainaccel.diloco.syncs,
        # Equal on every rank only if the replicas started equal: a sync averages their changes, not their values.
        "synced": digest(model.state_dict().values()),
    }


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"rank": rank, **{case: train(case, rank) for case in cases}}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
