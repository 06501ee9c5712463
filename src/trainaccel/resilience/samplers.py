"""Under on_lost_replica=continue, torch's `DistributedSampler` splits the data over the workers present.

A sampler built for the whole job (`num_replicas` its world size) takes, at the start of each pass over it
(`__iter__`, an epoch), the members the last sync ran with: the workers of the replicas present, this worker's place
among them. After a loss the survivors share the lost workers' part from the next epoch on; after a rejoin, the job's
split again. The epoch under way keeps the split it began with: a part lost mid-epoch is not trained on in that
epoch. Every member gets the same number of samples (torch's padding), so the replicas keep stepping alike.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable

import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from trainaccel import context
from trainaccel.context import info_once

log = logging.getLogger("trainaccel")

# Each sampler's (num_replicas, rank) as the script built it: only one built for the whole job follows.
_built: weakref.WeakKeyDictionary[DistributedSampler, tuple[int, int]] = weakref.WeakKeyDictionary()


def follow_membership(live_ranks: Callable[[], list[int] | None]) -> None:
    """From now until shutdown, each pass over a job-wide DistributedSampler splits the data over `live_ranks()`
    (the global ranks present, sorted; None: the whole job)."""
    if not context.first_time("samplers follow membership"):
        return
    context.on_undo("samplers follow membership", _built.clear)
    original = DistributedSampler.__iter__

    def __iter__(self: DistributedSampler):
        _follow(self, live_ranks())
        return original(self)

    context.patch(DistributedSampler, "__iter__", __iter__)


def _follow(sampler: DistributedSampler, live: list[int] | None) -> None:
    """Set `sampler`'s split to the workers in `live`, if it was built for the whole job and this worker is one."""
    built = _built.setdefault(sampler, (sampler.num_replicas, sampler.rank))
    if live is None or not dist.is_initialized():
        return
    rank = dist.get_rank()
    if built != (dist.get_world_size(), rank) or rank not in live:
        return  # built for another split (a subgroup, a custom rank: the script's), or this worker was left out
    replicas, place = len(live), live.index(rank)
    if (replicas, place) == (sampler.num_replicas, sampler.rank):
        return
    sampler.num_replicas, sampler.rank = replicas, place
    # What DistributedSampler.__init__ computes from them.
    size = len(sampler.dataset)  # type: ignore[arg-type]
    if sampler.drop_last and size % replicas != 0:
        sampler.num_samples = math.ceil((size - replicas) / replicas)
    else:
        sampler.num_samples = math.ceil(size / replicas)
    sampler.total_size = sampler.num_samples * replicas
    info_once(
        f"on_lost_replica=continue: DistributedSampler splits the data over the {replicas} workers present from "
        f"this epoch on ({sampler.num_samples} samples each; this worker's part {place})"
    )
    log.debug("DistributedSampler split over %d workers, part %d", replicas, place)
