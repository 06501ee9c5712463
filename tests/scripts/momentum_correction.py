"""Momentum correction (compression_momentum=auto) on real Gloo groups, against torch's SGD on the exact mean.

Run as 2 nodes x 2 workers (two torchrun launches with --nnodes 2); each rank writes OUT_DIR/rank{r}.json.
For every sparse codec x reduction x SGD setting: with ratio 1 (every element sent) the parameters equal
torch's SGD on the mean gradient; with ratio 0.1 they differ from it by exactly lr x the residuals.
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel
from trainaccel.comm import register

STEPS, WARMUP = 8, 3
SETTINGS = {
    "heavy_ball": dict(momentum=0.9),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "dampening": dict(momentum=0.8, dampening=0.3),
    "weight_decay": dict(momentum=0.9, nesterov=True, weight_decay=0.05),
    "groups": "weight decay on weights only, as scripts often do",
    "no_momentum": dict(weight_decay=0.01),
    "one_cycle": "OneCycleLR, which sets the momentum at every step",
}


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))


def optimizer_for(model: nn.Module, setting: str) -> torch.optim.SGD:
    if setting == "groups":
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
    if setting == "one_cycle":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, **SETTINGS[setting])


def scheduler_for(opt: torch.optim.SGD, setting: str):
    if setting == "one_cycle":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=STEPS, base_momentum=0.5)
    return torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)


def reference(setting: str, world: int) -> list[torch.Tensor]:
    """torch's SGD on the exact mean of every rank's gradient, with a changing learning rate."""
    model = build()
    opt = optimizer_for(model, setting)
    sched = scheduler_for(opt, setting)
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(world):
            x, y = batch(r, step)
            (nn.functional.mse_loss(model(x), y) / world).backward()
        opt.step()
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


def trained(setting: str, rank: int, **options) -> tuple[DDP, torch.optim.SGD, object]:
    model = DDP(build())
    state = register(model, compression_warmup=WARMUP, **options)
    opt = optimizer_for(model, setting)
    sched = scheduler_for(opt, setting)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    return model, opt, state


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
found: dict = {"rank": rank, "exact": {}, "settings": {}}
refs = {setting: reference(setting, world) for setting in SETTINGS}
opt_after = None  # the optimizer whose settings shutdown() gives back
for codec in ("topk", "randomk"):
    for hierarchical in ("off", "on"):
        for setting in SETTINGS:
            if os.environ.get("ONLY") and os.environ["ONLY"] != f"{codec}/{hierarchical}/{setting}":
                continue
            model, opt, state = trained(
                setting, rank, compression=codec, compression_ratio=1.0, hierarchical=hierarchical
            )
            err = max(float((p - q).abs().max()) for p, q in zip(model.module.parameters(), refs[setting]))
            found["exact"][f"{codec}/{hierarchical}/{setting}"] = {
                "max_abs_err": err,
                "hierarchical": state.hierarchy is not None,
                "moved": state.moved.momentum,
                "live_momentum": [g["momentum"] for g in opt.param_groups],
                "saved_groups": [
                    {k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]
                ],
                "buffers": sum("momentum_buffer" in s for s in opt.state.values()),
            }
            if codec == "topk" and hierarchical == "off" and setting == "groups":
                opt_after = opt
        dist.barrier()


# Ratio 0.1: what was applied is momentum SGD's update minus lr x every rank's residual (one parameter, one bucket,
# constant learning rate, a gradient that does not depend on the parameters).
class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.vector = nn.Parameter(torch.zeros(5000))

    def forward(self, x):
        return (self.vector * x).sum()


def drift(r: int, step: int) -> torch.Tensor:
    base, g = torch.Generator().manual_seed(7 + r), torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(5000, generator=base) + 0.5 * torch.randn(5000, generator=g)


for codec in ("topk", "randomk"):
    for nesterov in (False, True):
        ref = Linear()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov)
        model = DDP(Linear())
        state = register(model, compression=codec, compression_ratio=0.1, compression_warmup=WARMUP)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov)
        for step in range(STEPS):
            for m, o, x in (
                (ref, ref_opt, sum(drift(r, step) for r in range(world)) / world),
                (model, opt, drift(rank, step)),
            ):
                o.zero_grad()
                m(x).backward()
                o.step()
        residual = torch.cat([state.feedback.residuals[k] for k in sorted(state.feedback.residuals)])
        dist.all_reduce(residual)
        gap = model.module.vector.detach() - ref.vector.detach()
        found["settings"][f"{codec}/nesterov={nesterov}"] = {
            "max_abs_err": float((gap - 0.1 * residual).abs().max()),
            "gap": float(gap.abs().max()),
        }

# shutdown() gives the optimizer its own settings back.
trainaccel.shutdown()
found["after_shutdown"] = (
    [{k: v for k, v in g.items() if k != "params"} for g in opt_after.param_groups] if opt_after else []
)

# Optimizers it cannot take over keep their momentum, with one warning each kind.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model = DDP(build())
register(model, compression="topk", compression_ratio=0.5, compression_warmup=1)
adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    adam.zero_grad()
    nn.functional.mse_loss(model(batch(rank, step)[0]), batch(rank, step)[1]).backward()
    adam.step()
trainaccel.shutdown()


class WithSparse(nn.Module):
    """A sparse embedding bag in front of the dense layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.embedding, self.head = nn.EmbeddingBag(20, 12, mode="sum", sparse=True), build(1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids))


# Sparse gradients are averaged exactly, without the engine's velocities: the optimizer that steps them keeps its
# momentum (an optimizer of its own; or one with the dense layers too, which is then not taken over, with a warning).
found["sparse"] = {}
for layout in ("two", "one"):
    model = DDP(WithSparse())
    register(model, compression="topk", compression_ratio=0.5, compression_warmup=1)
    dense, sparse = list(model.module.head.parameters()), list(model.module.embedding.parameters())
    if layout == "two":
        opts = [torch.optim.SGD(dense, lr=0.1, momentum=0.9), torch.optim.SGD(sparse, lr=0.1, momentum=0.9)]
    else:
        opts = [torch.optim.SGD([{"params": dense}, {"params": sparse}], lr=0.1, momentum=0.9)]
    for step in range(4):
        ids = torch.randint(0, 20, (8, 3), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = nn.functional.mse_loss(model(ids), batch(rank, step)[1])
        for opt in opts:
            opt.zero_grad()
        loss.backward()
        for opt in opts:
            opt.step()
    found["sparse"][layout] = [[group["momentum"] for group in opt.param_groups] for opt in opts]
    trainaccel.shutdown()

with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(found, f)
dist.destroy_process_group()
