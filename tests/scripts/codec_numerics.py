"""Codec and hierarchy numerics on real Gloo groups, compared with the exact mean of every rank's gradient.

Run as 2 nodes x 2 workers (two torchrun launches with --nnodes 2); each rank writes OUT_DIR/rank{r}.json.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainaccel.comm import register
from trainaccel.comm.codecs import get_codec

N, ROWS, COLS = 10_001, 64, 48  # 13,073 elements: not divisible by the 2 workers of a node


class Grads(nn.Module):
    """The gradient of forward(x, m) is (x, m): each rank chooses exactly what it contributes."""

    def __init__(self):
        super().__init__()
        self.vector = nn.Parameter(torch.zeros(N))
        self.matrix = nn.Parameter(torch.zeros(ROWS, COLS))

    def forward(self, x, m):
        return (self.vector * x).sum() + (self.matrix * m).sum()


def gradient(rank: int, step: int, kind: str = "random") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "drift":  # a steady direction per rank plus noise: what a training signal looks like
        base = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(N, generator=base) + 0.5 * torch.randn(N, generator=g)
        m = torch.randn(ROWS, COLS, generator=base) + 0.5 * torch.randn(ROWS, COLS, generator=g)
        return x, m
    if kind == "lowrank":  # every rank's matrix lies in one shared rank-2 space, so the mean does too
        shared = torch.Generator().manual_seed(99)
        u, v = torch.randn(ROWS, 2, generator=shared), torch.randn(2, COLS, generator=shared)
        return torch.randn(N, generator=g), u @ torch.diag(torch.randn(2, generator=g)) @ v
    return torch.randn(N, generator=g) * 3, torch.randn(ROWS, COLS, generator=g) * 3


def exact_mean(world: int, step: int, kind: str = "random") -> torch.Tensor:
    parts = [torch.cat([x, m.flatten()]) for x, m in (gradient(r, step, kind) for r in range(world))]
    return sum(parts) / world


def applied(model: DDP, rank: int, step: int, kind: str = "random") -> torch.Tensor:
    """Run one backward on this rank's gradient; return the reduced gradient DDP leaves in .grad."""
    model.zero_grad(set_to_none=True)
    model(*gradient(rank, step, kind)).backward()
    return torch.cat([model.module.vector.grad, model.module.matrix.grad.flatten()])


def fresh(bucket_cap_mb: float | None = None, **options) -> tuple[DDP, object]:
    """A registered model past its first step: lossy codecs start after DDP's final buckets (PowerSGD counts its own)."""
    model = DDP(Grads(), bucket_cap_mb=bucket_cap_mb)
    state = register(model, **{"compression_warmup": 1, **options})
    if options.get("compression") != "powersgd":
        model(torch.zeros(N), torch.zeros(ROWS, COLS)).backward()  # reduced exactly: nothing to carry over
        state.flat_bytes_sent = 0  # bytes_sent counts from here on
        if state.hierarchy is not None:
            state.hierarchy.bytes_sent = 0
    return model, state


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
found: dict = {"rank": rank}

# Lossless: hierarchical and flat both give the exact mean.
for name, options in {"flat": dict(hierarchical="off"), "hierarchical": dict(hierarchical="on")}.items():
    model, state = fresh(**options)
    errors = [(applied(model, rank, step) - exact_mean(world, step)).abs().max().item() for step in (1, 2, 3)]
    found[name] = {
        "max_abs_err": max(errors),
        "hierarchical": state.hierarchical,
        "bytes_per_step": state.bytes_per_step() if state.builtin else state.bytes_sent / 3,
    }

# fp16 across nodes (full precision within): rounding only.
model, state = fresh(compression="fp16", hierarchical="on")
exact = exact_mean(world, 1)
found["fp16_hierarchical"] = {
    "max_abs_err": (applied(model, rank, 1) - exact).abs().max().item(),
    "max_abs": exact.abs().max().item(),
    "hierarchical": state.hierarchical,
}

# fp16 inside the node too (intra_compression), full fp16 path: rounding only.
model, state = fresh(compression="fp16", intra_compression="fp16", hierarchical="on")
exact = exact_mean(world, 1)
found["intra_fp16"] = {
    "max_abs_err": (applied(model, rank, 1) - exact).abs().max().item(),
    "max_abs": exact.abs().max().item(),
    "hierarchical": state.hierarchical,
}

# topk, one step: each rank drops only elements below its k-th largest magnitude tau_r,
# so |result - exact| <= sum_r tau_r / world elementwise.
ratio = 0.01
model, state = fresh(compression="topk", compression_ratio=ratio)
result, exact = applied(model, rank, 1), exact_mean(world, 1)
k = -(-(N + ROWS * COLS) * ratio // 1)
taus = [
    torch.cat([x, m.flatten()]).abs().kthvalue(N + ROWS * COLS - int(k) + 1).values.item()
    for x, m in (gradient(r, 1) for r in range(world))
]
found["topk"] = {
    "max_abs_err": (result - exact).abs().max().item(),
    "bound": sum(taus) / world,
    "nonzero": int((result != 0).sum()),
    "k": int(k),
    "bytes_per_step": state.bytes_sent,  # one step
    "hierarchical": state.hierarchical,
}

# randomk, one step: the exact mean on the kept elements, zero elsewhere.
model, state = fresh(compression="randomk", compression_ratio=0.1)
result, exact = applied(model, rank, 1), exact_mean(world, 1)
kept = result != 0
found["randomk"] = {
    "kept": int(kept.sum()),
    "kept_err": (result[kept] - exact[kept]).abs().max().item(),
    "bytes_per_step": state.bytes_sent,  # one step
}

# powersgd, one compressed step (steps 1 and 2 are plain allreduces): exact when the mean has
# rank <= r; otherwise a projection of the mean, so the error is at most the mean's own norm.
for kind in ("lowrank", "random"):
    model, state = fresh(compression="powersgd", powersgd_rank=2)
    applied(model, rank, 1, kind), applied(model, rank, 2, kind)
    sent_before = state.bytes_sent
    result, exact = applied(model, rank, 3, kind), exact_mean(world, 3, kind)
    matrix_err = (result[N:] - exact[N:]).norm().item()
    found[f"powersgd_{kind}"] = {
        "matrix_rel_err": matrix_err / exact[N:].norm().item(),
        "vector_max_abs_err": (result[:N] - exact[:N]).abs().max().item(),
        "bytes_compressed_step": state.bytes_sent - sent_before,
    }

# Error feedback over 50 steps: the sum of applied updates tracks the sum of exact means.
# The same codec without feedback (simulated here from its own compress/decompress) does not.
STEPS = 50
for name, options in {
    "fp16": dict(compression="fp16"),
    "topk": dict(compression="topk", compression_ratio=0.1),
    "topk_1%": dict(compression="topk", compression_ratio=0.01),
    "topk_hierarchical": dict(compression="topk", compression_ratio=0.1, hierarchical="on"),
    # The adaptive ratio: 1% at first, raised (every 10 steps, up to 20%) while the residual holds much back.
    "topk_adaptive": dict(compression="topk", compression_ratio=0.01, compression_ratio_max=0.2),
    "randomk_adaptive_hierarchical": dict(
        compression="randomk", compression_ratio=0.01, compression_ratio_max=0.2, hierarchical="on"
    ),
    "randomk": dict(compression="randomk", compression_ratio=0.1),
    "powersgd": dict(compression="powersgd", powersgd_rank=2),
    # Several buckets in flight at once (torch's PowerSGD hook alone can deadlock Gloo here).
    "powersgd_buckets": dict(compression="powersgd", powersgd_rank=2, bucket_cap_mb=0.01),
    "hierarchical_buckets": dict(hierarchical="on", bucket_cap_mb=0.01),
}.items():
    model, state = fresh(**options)
    total_applied = torch.zeros(N + ROWS * COLS)
    total_exact = torch.zeros_like(total_applied)
    for step in range(1, STEPS + 1):
        total_applied += applied(model, rank, step, "drift")
        total_exact += exact_mean(world, step, "drift")
    entry = {"rel_err": ((total_applied - total_exact).norm() / total_exact.norm()).item()}
    entry["hierarchical"] = state.hierarchical
    adaptive = getattr(state.codec, "adaptive", None)
    if adaptive is not None:
        entry["ratios"] = sorted([str(key), value[0]] for key, value in adaptive.ratios.items())
    if options.get("compression") in ("topk", "randomk") and "hierarchical" not in options and adaptive is None:
        codec = get_codec(options["compression"], ratio=options["compression_ratio"])
        total_plain = torch.zeros_like(total_applied)
        for step in range(1, STEPS + 1):
            parts = [torch.cat([x, m.flatten()]) / world for x, m in (gradient(r, step, "drift") for r in range(world))]
            if codec.summable:  # every rank draws the same elements: one compress per step stands for all
                payload, ctx = codec.compress(sum(parts))
                total_plain += codec.decompress(payload, ctx)
            else:
                for part in parts:
                    total_plain += codec.decompress(*codec.compress(part))
        entry["rel_err_without_feedback"] = ((total_plain - total_exact).norm() / total_exact.norm()).item()
    found[f"feedback_{name}"] = entry

with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(found, f)
dist.destroy_process_group()
