"""Horovod's life cycle on torch.distributed: init, shutdown and is_initialized."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from trainaccel.horovod import ops
from trainaccel.horovod.basics import check_initialized
from trainaccel.horovod.process_sets import add_process_set
from trainaccel.horovod.process_sets import reset as reset_process_sets

_started_here = False  # init() brought up the process group, so shutdown() takes it down


def init(comm: object = None, process_sets: Any = None) -> None:
    """Join the job: under `trainaccel run`, torchrun, mpirun or horovodrun; alone, a job of one.

    `process_sets`: ProcessSets (or rank lists) to register now, or "dynamic" (always allowed here).
    `comm` (an MPI communicator) is not supported: trainaccel does not use MPI.
    """
    global _started_here
    if comm is not None:
        from trainaccel.horovod.exceptions import UnsupportedOperation

        raise UnsupportedOperation(
            "init(comm=...) needs MPI, which trainaccel does not use; launch with trainaccel run"
        )
    if process_sets is not None and process_sets != "dynamic" and not isinstance(process_sets, (list, tuple)):
        raise ValueError(f"invalid process_sets={process_sets!r}; accepted: a list of ProcessSets or 'dynamic'")
    import trainaccel
    from trainaccel.context import current_config
    from trainaccel.environment import is_distributed

    was_up = dist.is_initialized()
    if current_config() is None or not was_up:
        trainaccel.init()
    # else: the script's own trainaccel.init(...) (or trainaccel run's) came first: its options stand
    if not dist.is_initialized() and not is_distributed():
        # A script started without a launcher is a job of one, as with Horovod.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _started_here = _started_here or (not was_up and dist.is_initialized())
    from trainaccel.comm.exit_guard import guard_exit

    guard_exit()  # Gloo's threads may still be winding down when a short script exits
    if not was_up:
        _forget_state()
    # Collective: done now, on every worker, rather than lazily inside local_rank() on some.
    check_initialized()
    from trainaccel.comm.topology import discover

    discover()
    if isinstance(process_sets, (list, tuple)):
        for ps in process_sets:
            add_process_set(ps)


def _forget_state() -> None:
    """Operations in flight and process sets belong to one process group's lifetime."""
    ops.reset()
    reset_process_sets()


def is_initialized() -> bool:
    """Whether a process group is up (started by `init()` or by the script itself)."""
    return dist.is_initialized()


def shutdown() -> None:
    """Leave the job; the process group is destroyed if `init()` started it."""
    global _started_here
    if _started_here and dist.is_initialized():
        _forget_state()
        dist.destroy_process_group()
    _started_here = False
