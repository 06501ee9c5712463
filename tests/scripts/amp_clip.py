"""A plain DDP script that clips gradients and steps a scheduler each step, plus the one line fp16 needs.

Usage: amp_clip.py OUT_DIR STEPS [--inf-at STEP]: rank r writes OUT_DIR/rank{r}.json.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel.amp

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("steps", type=int)
parser.add_argument("--inf-at", type=int, help="multiply this step's loss by inf (an overflow the scaler must skip)")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
teacher = torch.Generator().manual_seed(7)
W = torch.randn(32, 4, generator=teacher)  # gradient norms above the clip for most of the run


def batch(generator: torch.Generator, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, 32, generator=generator)
    return x, x @ W + 0.5 * torch.randn(size, 4, generator=generator)


torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
optimizer = trainaccel.amp.scaled(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.995)
real_steps = 0


def count(opt, args, kwargs):
    global real_steps
    real_steps += 1


optimizer.register_step_post_hook(count)
data = torch.Generator().manual_seed(100 + rank)
losses, norms = [], []
for step in range(args.steps):
    x, y = batch(data)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    (loss * float("inf") if step == args.inf_at else loss).backward()
    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
    optimizer.step()
    scheduler.step()
    losses.append(loss.item())

x_eval, y_eval = batch(torch.Generator().manual_seed(99), 2048)
with torch.no_grad():
    eval_loss = nn.functional.mse_loss(model.module(x_eval), y_eval).item()  # the inner module: float32
scaler = getattr(optimizer, "trainaccel_scaler", None)
result = {
    "losses": losses,
    "norms": norms,
    "eval_loss": eval_loss,
    "real_steps": real_steps,
    "last_epoch": scheduler.last_epoch,
    "lr": scheduler.get_last_lr()[0],
    "grad_scale": scaler.get_scale() if scaler else None,
    "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
}
with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
