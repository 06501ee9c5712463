"""Translate the rank variables of MPI-style launchers into torch.distributed's env:// names."""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

# torch name -> launcher variables that carry it, first match wins.
# Open MPI (mpirun), PMI (MPICH, Intel MPI, Slurm's PMI), MPICH/Hydra's local ids,
# and Horovod's own launcher (horovodrun with Gloo).
MPI_VARIABLES: dict[str, tuple[str, ...]] = {
    "RANK": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "HOROVOD_SIZE"),
    "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "HOROVOD_LOCAL_RANK"),
    "LOCAL_WORLD_SIZE": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "HOROVOD_LOCAL_SIZE"),
}


def map_mpi_env(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE from MPI variables where absent.

    Returns the variables it set, with the values; existing torch variables always win.
    """
    env = os.environ if env is None else env
    added: dict[str, str] = {}
    for torch_name, sources in MPI_VARIABLES.items():
        if torch_name in env:
            continue
        for source in sources:
            if source in env:
                added[torch_name] = env[source]
                break
    env.update(added)
    return added


def is_distributed(env: MutableMapping[str, str] | None = None) -> bool:
    """Whether the environment describes a multi-process job (torchrun or mapped MPI)."""
    env = os.environ if env is None else env
    return "WORLD_SIZE" in env and "RANK" in env


def env_rank(env: MutableMapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    return int(env.get("RANK", "0"))


def env_world_size(env: MutableMapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    return int(env.get("WORLD_SIZE", "1"))


def worker_place(env: MutableMapping[str, str] | None = None) -> tuple[str, int]:
    """(host name, local rank) of this worker: how reports name where a rank runs."""
    env = os.environ if env is None else env
    return socket.gethostname(), int(env.get("LOCAL_RANK", "0"))
