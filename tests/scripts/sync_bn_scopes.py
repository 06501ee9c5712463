"""convert_sync_batchnorm's scopes on an emulated 2-node job: statistics over the node's or all workers' batches.

Each rank checks its output, its input's gradient and the running statistics against one BatchNorm run
in-process over the joined batches of the ranks in its scope. Usage: sync_bn_scopes.py OUT_DIR
"""

import copy
import os
import sys
import time

import torch
import torch.distributed as dist
from checks import Checks
from torch import nn

from trainaccel.batchnorm import SyncBatchNorm, convert_sync_batchnorm


def batch(rank: int) -> torch.Tensor:
    """Uneven batch sizes and distributions that differ per rank."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(3 + rank, 4, 5, 5, generator=g) * (1 + rank) + rank


def upstream(rank: int) -> torch.Tensor:
    return torch.randn(batch(rank).shape, generator=torch.Generator().manual_seed(100 + rank))


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    checks = Checks()
    for scope in ("global", "node"):
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
        model = convert_sync_batchnorm(copy.deepcopy(reference), scope=scope)
        checks.check(f"{scope}: converted", type(model[1]) is SyncBatchNorm)
        x = batch(rank).requires_grad_(True)
        out = model(x)
        (out * upstream(rank)).sum().backward()

        members = (
            list(range(world))
            if scope == "global"
            else list(range(rank - rank % per_node, rank - rank % per_node + per_node))
        )
        xs = [batch(r).requires_grad_(True) for r in members]
        ref_out = reference(torch.cat(xs))
        (ref_out * torch.cat([upstream(r) for r in members])).sum().backward()
        start = sum(batch(r).shape[0] for r in members[: members.index(rank)])
        mine = ref_out[start : start + x.shape[0]]
        checks.check(f"{scope}: output", torch.allclose(out, mine, atol=1e-5))
        checks.check(f"{scope}: input gradient", torch.allclose(x.grad, xs[members.index(rank)].grad, atol=1e-5))
        for name in ("running_mean", "running_var"):
            ok = torch.allclose(getattr(model[1], name), getattr(reference[1], name), atol=1e-5)
            checks.check(f"{scope}: {name}", ok)
        model.eval()
        checks.check(
            f"{scope}: eval uses the running statistics", torch.allclose(model(x), reference.eval()(x), atol=1e-5)
        )
    checks.raises(
        "bad scope",
        lambda: convert_sync_batchnorm(nn.BatchNorm1d(2), scope="rack"),
        ValueError,
        "invalid scope 'rack'; accepted: global, node",
    )
    checks.write(out_dir, rank)
    # As in bench.worker: let Gloo's threads finish with the last collectives (they need the GIL)
    # before the groups, node groups included, are torn down.
    dist.barrier()
    time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
