"""Horovod's setup and topology queries on torch.distributed: init, size, rank, local and cross ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

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
    from trainaccel.environment import is_distributed

    was_up = dist.is_initialized()
    trainaccel.init()
    if not dist.is_initialized() and not is_distributed():
        # A script started without a launcher is a job of one, as with Horovod.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _started_here = _started_here or (not was_up and dist.is_initialized())
    from trainaccel.comm.exit_guard import guard_exit

    guard_exit()  # Gloo's threads may still be winding down when a short script exits
    if not was_up:
        _forget_state()
    _topology()  # collective: done now, on every worker, rather than lazily inside local_rank() on some
    if isinstance(process_sets, (list, tuple)):
        from trainaccel.horovod.process_sets import add_process_set

        for ps in process_sets:
            add_process_set(ps)


def _forget_state() -> None:
    """Operations in flight and process sets belong to one process group's lifetime."""
    from trainaccel.horovod import ops, process_sets

    ops.reset()
    process_sets._reset()


def is_initialized() -> bool:
    return dist.is_initialized()


def shutdown() -> None:
    """Leave the job; the process group is destroyed if `init()` started it."""
    global _started_here
    if _started_here and dist.is_initialized():
        _forget_state()
        dist.destroy_process_group()
    _started_here = False


def _check() -> None:
    if not dist.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def size() -> int:
    _check()
    return dist.get_world_size()


def rank() -> int:
    _check()
    return dist.get_rank()


def _topology():
    from trainaccel.comm.topology import discover

    _check()
    return discover()


def local_size() -> int:
    return _topology().local_size


def local_rank() -> int:
    return _topology().local_index


def cross_size() -> int:
    """Workers with this worker's local rank, one per node (Horovod's cross communicator)."""
    topology = _topology()
    return sum(1 for node in topology.nodes if len(node) > topology.local_index)


def cross_rank() -> int:
    return _topology().node_index


def is_homogeneous() -> bool:
    """Whether every node runs the same number of workers."""
    return _topology().uniform


def mpi_threads_supported() -> bool:
    return False


def mpi_built(verbose: bool = False) -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def gloo_built(verbose: bool = False) -> bool:
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    return dist.is_gloo_available()


def nccl_built(verbose: bool = False) -> bool:
    return dist.is_nccl_available() and torch.cuda.is_available()


def cuda_built(verbose: bool = False) -> bool:
    return torch.backends.cuda.is_built()


def rocm_built(verbose: bool = False) -> bool:
    return torch.version.hip is not None


def ddl_built(verbose: bool = False) -> bool:
    return False


def ccl_built(verbose: bool = False) -> bool:
    return False
