"""Horovod's process sets: collectives among a subset of the workers, each set a torch process group."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch.distributed as dist

from trainaccel.horovod import background
from trainaccel.horovod.basics import check_initialized


class ProcessSet:
    """A set of global ranks that run collectives together; register it with `add_process_set` or `init`."""

    def __init__(self, ranks: Sequence[int]):
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) and not hasattr(ranks, "__iter__"):
            raise ValueError(f"invalid ranks={ranks!r}; accepted: a list of global ranks")
        ranks = sorted(ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"invalid ranks={ranks!r}; accepted: a list of integer global ranks")
        self.ranks: list[int] = ranks
        self.process_set_id: int | None = None
        self.group: dist.ProcessGroup | None = None  # None: the default (global) group

    def size(self) -> int | None:
        """Workers in the set, or None before it is registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This worker's rank within the set (its place in `ranks`), or None before registration."""
        if self.process_set_id is None:
            return None
        return self.ranks.index(dist.get_rank()) if self.included() else None

    def included(self) -> bool | None:
        """Whether this worker belongs to the set, or None before registration."""
        return None if self.process_set_id is None else dist.get_rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_registered: dict[int, ProcessSet] = {}
_ids = itertools.count(1)


def reset() -> None:
    """Forget every set (at init and shutdown); the global set takes the current world."""
    global _ids
    for ps in _registered.values():
        ps.process_set_id, ps.group = None, None
    _registered.clear()
    _ids = itertools.count(1)
    global_process_set.ranks = list(range(dist.get_world_size())) if dist.is_initialized() else []


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a set on every worker (all must call it, in the same order) and return it."""
    check_initialized()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    world = dist.get_world_size()
    if not ps.ranks or len(set(ps.ranks)) != len(ps.ranks) or not 0 <= ps.ranks[0] <= ps.ranks[-1] < world:
        raise ValueError(f"invalid process set ranks {ps.ranks}; accepted: distinct ranks from 0 to {world - 1}")
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    if ps.ranks == global_process_set.ranks or any(other.ranks == ps.ranks for other in _registered.values()):
        raise ValueError(f"a process set with ranks {ps.ranks} already exists; process sets must differ")
    background.drain()  # after the optimizer's collectives submitted so far, as on every other rank
    ps.group = dist.new_group(ps.ranks)  # collective over the whole world, as in Horovod
    ps.process_set_id = next(_ids)
    _registered[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set (every worker calls it); False for the global set or one not registered."""
    check_initialized()
    if process_set.process_set_id in (None, 0) or process_set.process_set_id not in _registered:
        return False
    del _registered[process_set.process_set_id]
    background.drain()  # no job of the optimizer may still use the group
    if dist.get_rank() in process_set.ranks:
        dist.destroy_process_group(process_set.group)
    process_set.process_set_id, process_set.group = None, None
    return True


def resolve(process_set: ProcessSet | None) -> ProcessSet:
    """The set an operation runs on, checked: registered and including this worker."""
    ps = global_process_set if process_set is None else process_set
    if ps is global_process_set and len(ps.ranks) != dist.get_world_size():
        ps.ranks = list(range(dist.get_world_size()))  # the group was started without hvd.init()
    if not isinstance(ps, ProcessSet):
        raise ValueError(f"invalid process_set={ps!r}; accepted: a ProcessSet from hvd.add_process_set or None")
    if ps.process_set_id is None:
        raise ValueError(f"{ps} is not registered; pass it to hvd.add_process_set first")
    if ps.process_set_id and dist.get_rank() not in ps.ranks:
        raise ValueError(f"rank {dist.get_rank()} is not in {ps}; only its members may use it")
    return ps
