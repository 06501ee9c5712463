"""fp16 with `fp16_scale=peak` (and `dynamic`, for comparison) against the exact mean, on real Gloo workers.

Run as 2 emulated nodes x 2 workers. Each case gives every rank a gradient of known values (a parameter whose
gradient is the input); each cell registers a fresh DDP model and reads its second step's gradient (the first is
reduced exactly by design, so the second is the first compressed one, with no residual yet). Rank 0 writes
OUT_DIR/fp16_peak.json: per cell, the worst error against the float64 mean (relative to the tolerance below), the
non-finite places got and expected, the exact retries, and whether every rank got the same bits.
Usage: fp16_peak.py OUT_DIR
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from weights import Weights

from trainaccel.comm import register

N = 4099  # not a multiple of the node's workers: the hierarchy pads its shards
CASES = ["normal", "tiny", "huge", "wide", "zeros", "same_on_all", "ranks_apart", "inf_on_one", "nan_on_one"]


def gradient(case: str, rank: int, world: int) -> torch.Tensor:
    # same_on_all: every rank's largest value at the same place, with the same sign: the sum reaches `world` times
    # each payload's largest value, which the scale must leave room for
    g = torch.Generator().manual_seed(1000 if case == "same_on_all" else 1000 + rank)
    x = torch.randn(N, generator=g, dtype=torch.float64)
    if case == "normal":
        x *= 1e-2
    elif case == "tiny":  # below float16's normal range (6e-5) at scale 1
        x *= 1e-9
    elif case == "huge":  # beyond float16's range (65504)
        x *= 1e6
    elif case == "wide":  # magnitudes 1e-12 .. 1e4, random signs
        x = x.sign() * torch.logspace(-12, 4, N, dtype=torch.float64)[torch.randperm(N, generator=g)]
    elif case == "same_on_all":
        x *= 1e2
    elif case == "zeros":
        x.zero_()
    elif case == "ranks_apart":  # rank 0 a million times larger than the others
        x *= 1e3 if rank == 0 else 1e-3
    elif case in ("inf_on_one", "nan_on_one"):
        x *= 1e-2
        if rank == world - 1:
            x[7] = float("inf") if case == "inf_on_one" else float("nan")
            x[N - 3] = -float("inf") if case == "inf_on_one" else float("nan")
    return x


def cell(case: str, scale: str, hierarchical: str) -> dict:
    """`hierarchical`: off, on, or intra (on, with fp16 inside the node as well: three fp16 stages)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(Weights(N))
    intra = "fp16" if hierarchical == "intra" else "none"
    on = "off" if hierarchical == "off" else "on"
    state = register(model, compression="fp16", fp16_scale=scale, hierarchical=on, intra_compression=intra)
    mine = gradient(case, rank, world)
    for _ in range(2):
        model.module.weight.grad = None
        model(mine.float()).backward()
    got = model.module.weight.grad.double()
    every = torch.stack([gradient(case, r, world).float().double() for r in range(world)])
    exact = every.mean(0)
    finite = exact.isfinite()
    # Per element: fp16's roundings of the sum (cast, additions) relative to the sum of magnitudes, and a floor of
    # subnormal spacing relative to the group's largest magnitude.
    magnitudes = every.abs().where(every.isfinite(), torch.zeros_like(every)).sum(0) / world
    peak = float(magnitudes.max()) * world
    # Flat: the cast and 3 additions, each within 2^-11; fp16 in the node too: 3 casts and 2 additions.
    tolerance = (2.0**-8 if hierarchical == "intra" else 2.0**-9) * magnitudes + peak * 2.0**-30
    diff = (got - exact).abs().where(finite, torch.zeros_like(got))
    zero, inf = torch.zeros_like(diff), torch.full_like(diff, float("inf"))
    error = torch.where(tolerance > 0, diff / tolerance, torch.where(diff > 0, inf, zero))
    gathered = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(gathered, got)
    return {
        "worst": float(error.max()),
        "nonfinite_got": (~got.isfinite()).nonzero().flatten().tolist(),
        "nonfinite_expected": (~finite).nonzero().flatten().tolist(),
        "fallbacks": state.fallbacks,
        "hierarchical": state.hierarchical,
        # NaN != NaN: the places of NaN and of each infinity are compared, and the finite values' bits
        "replicas_equal": all(
            torch.equal(g.nan_to_num(0.0, 1.0, -1.0), got.nan_to_num(0.0, 1.0, -1.0)) for g in gathered
        )
        and all(torch.equal(g.isnan(), got.isnan()) for g in gathered),
    }


dist.init_process_group("gloo")
results = {}
for case in CASES:
    for scale in ("peak", "dynamic"):
        for hierarchical in ("off", "on", "intra"):
            results[f"{case}/{scale}/{hierarchical}"] = cell(case, scale, hierarchical)
if dist.get_rank() == 0:
    with open(f"{sys.argv[1]}/fp16_peak.json", "w") as f:
        json.dump(results, f, indent=1)
dist.barrier()
dist.destroy_process_group()
