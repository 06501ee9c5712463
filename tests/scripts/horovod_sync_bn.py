"""SyncBatchNorm on real workers: each rank records its inputs, outputs, gradients and running statistics.

Usage: horovod_sync_bn.py OUT_DIR. Rank r saves {case: record} to OUT_DIR/rank{r}.pt for the test to check
against one BatchNorm over the joined batches.
"""

import sys
from pathlib import Path

import torch

import trainaccel.horovod as hvd
from trainaccel.horovod.sync_batch_norm import SyncBatchNorm

hvd.init()
rank, size = hvd.rank(), hvd.size()


def run_case(
    seed: int,
    rows: int,
    shape: tuple,
    dtype: torch.dtype,
    momentum: float | None = 0.1,
    track: bool = True,
    process_set=None,
    steps: int = 3,
) -> dict:
    """Train `steps` steps on this rank's own data, then evaluate; return everything the test compares."""
    channels = shape[0]
    bn = SyncBatchNorm(channels, momentum=momentum, track_running_stats=track, process_set=process_set).to(dtype)
    init = torch.Generator().manual_seed(seed)  # the same parameters on every rank
    with torch.no_grad():
        bn.weight.copy_(torch.rand(channels, generator=init) + 0.5)
        bn.bias.copy_(torch.randn(channels, generator=init))
    data = torch.Generator().manual_seed(1000 * seed + rank)  # each rank its own batches
    record = {"momentum": momentum, "weight": bn.weight.detach().clone(), "bias": bn.bias.detach().clone(), "steps": []}
    for step in range(steps):
        # Far from zero, so that a sum-of-squares variance would lose precision.
        x = (torch.randn(rows, *shape, generator=data, dtype=dtype) * 3 + 50 + step).requires_grad_()
        g = torch.randn(rows, *shape, generator=data, dtype=dtype)
        bn.zero_grad()
        out = bn(x)
        (out * g).sum().backward()
        record["steps"].append(
            {
                "x": x.detach(),
                "g": g,
                "out": out.detach(),
                "dx": x.grad,
                "dw": bn.weight.grad.clone(),
                "db": bn.bias.grad.clone(),
            }
        )
    if track:
        record.update(
            running_mean=bn.running_mean.clone(),
            running_var=bn.running_var.clone(),
            num_batches_tracked=int(bn.num_batches_tracked),
        )
    bn.eval()
    x = torch.randn(rows, *shape, generator=data, dtype=dtype) * 3 + 50
    record["eval"] = {"x": x, "out": bn(x).detach()}
    return record


cases = {
    "even_2d": run_case(1, 4, (3, 5, 5), torch.float64),
    "uneven_float32": run_case(2, rank + 1, (4, 6), torch.float32, momentum=None),
    "empty_rank": run_case(3, 0 if rank == 1 else rank + 2, (3,), torch.float64),
    "no_running_stats": run_case(4, rank + 2, (3,), torch.float64, track=False, steps=2),
}
if size == 3:
    # Every rank creates both sets, in the same order; each then normalizes over its own.
    first, second = hvd.add_process_set([0, 1]), hvd.add_process_set([2])
    own = first if rank in first.ranks else second
    cases["process_sets"] = run_case(5, rank + 2, (3, 4, 4), torch.float64, process_set=own)
    cases["process_sets"]["ranks"] = own.ranks
torch.save(cases, Path(sys.argv[1]) / f"rank{rank}.pt")
