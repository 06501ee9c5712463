"""Horovod's topology and build queries on torch.distributed: size, rank, local and cross ranks (init: lifecycle.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def check_initialized() -> None:
    """Raise Horovod's ValueError unless a process group is up (`hvd.init()` has run)."""
    if not dist.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def size() -> int:
    check_initialized()
    return dist.get_world_size()


def rank() -> int:
    check_initialized()
    return dist.get_rank()


def _topology():
    from trainaccel.comm.topology import discover

    check_initialized()
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
