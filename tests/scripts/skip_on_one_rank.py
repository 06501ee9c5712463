"""A loop that skips its optimizer step when the gradient norm is not finite, as many training scripts do; rank 1's
gradients are made non-finite at one iteration. Each rank writes OUT_DIR/rank{r}.json: its skips and, under
trainaccel, its inner steps and syncs."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, BAD_STEP = 12, 3

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
generator = torch.Generator().manual_seed(rank)
skipped = 0
for step in range(STEPS):
    x = torch.randn(16, 4, generator=generator)
    if rank == 1 and step == BAD_STEP:
        x[0, 0] = float("inf")
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
    if not torch.isfinite(norm):
        skipped += 1
        optimizer.zero_grad()
        continue
    optimizer.step()
observer = getattr(model, "trainaccel", None)
diloco = observer.diloco if observer is not None else None
report = {"skipped": skipped}
if diloco is not None:
    report.update(steps=diloco.steps, syncs=diloco.syncs)
(out / f"rank{rank}.json").write_text(json.dumps(report))
dist.destroy_process_group()
