"""Which device is this process's, and which device a collective over a group takes: the one place that tells a CUDA
group (NCCL) from a CPU one (Gloo, MPI, or the CPU half of `cpu:gloo,cuda:nccl`)."""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

# Backends that reduce CPU tensors; "fake" is torch's stand-in without communication (a replica rejoining a running
# job has it as its default group, and its syncs run over Gloo groups of the members).
CPU_BACKENDS = ("gloo", "mpi", "ucc", "fake")


def local_cuda_index(env: Mapping[str, str] | None = None) -> int | None:
    """This worker's GPU among those it sees: None without CUDA; 0 where it sees one (a launcher that gives each worker
    its own GPU through CUDA_VISIBLE_DEVICES); else LOCAL_RANK, which must name a visible GPU."""
    env = os.environ if env is None else env
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if count == 1:
        return 0
    local = int(env.get("LOCAL_RANK", "0"))
    if local >= count:
        raise RuntimeError(
            f"LOCAL_RANK={local}, and this worker sees {count} GPUs (CUDA_VISIBLE_DEVICES="
            f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')}): accepted, LOCAL_RANK below {count}, or one visible GPU per "
            "worker; start at most one worker per GPU (--nproc-per-node)"
        )
    return local


def select_local_device(env: Mapping[str, str] | None = None) -> torch.device | None:
    """Make this worker's GPU the current CUDA device unless the script chose one already (a current device other than
    0): object collectives, NCCL's groups and a plain "cuda" then mean it, not GPU 0 on every worker."""
    index = local_cuda_index(env)
    if index is None:
        return None
    if torch.cuda.current_device() == 0 and index != 0:
        torch.cuda.set_device(index)
    return torch.device("cuda", torch.cuda.current_device())


def group_device(group: dist.ProcessGroup | None = None, near: torch.device | None = None) -> torch.device:
    """Where a tensor handed to a collective over `group` must live: `near` (the tensors' own device) where a backend of
    the group reduces that device's tensors natively (a GPU's over the NCCL half of "cpu:gloo,cuda:nccl"); else the
    CPU where the group reduces CPU tensors, else this worker's current GPU (an NCCL-only group)."""
    if near is not None and near.type != "cpu" and backend_of(group, near) not in CPU_BACKENDS:
        return near
    if uses_cpu(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def uses_cpu(group: dist.ProcessGroup | None = None) -> bool:
    """Whether `group` reduces CPU tensors (a CPU backend, alone or beside NCCL)."""
    return backend_of(group, torch.device("cpu")) in CPU_BACKENDS


def backend_of(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The backend that reduces `device`'s tensors over `group`: "gloo" for the CPU half of "cpu:gloo,cuda:nccl"."""
    backend = str(dist.get_backend(group)).lower()
    if ":" not in backend:
        return backend
    parts = dict(part.strip().split(":", 1) for part in backend.split(","))  # a backend per device type
    return parts.get(device.type, backend)


def by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` that hold values (not on the meta device), grouped by dtype in order of first appearance: one flat
    buffer each for a collective (DDP coalesces so too)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = collections.defaultdict(list)
    for tensor in tensors:
        if not tensor.is_meta:
            groups[tensor.dtype].append(tensor)
    return list(groups.values())


def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """`group`'s first rank's values (the job's rank 0 by default) into `tensors` on every rank: one broadcast per
    dtype (DDP coalesces too), on the tensors' device where the group's backend takes it (a GPU module's over NCCL even
    where the group also has Gloo for the CPU), else the group's (a CPU module's cross an NCCL-only group on the GPU).
    Tensors on the meta device hold no values and are left out (the script's own initialisation gives them theirs)."""
    near = next((t.device for t in tensors if not t.is_meta), None)
    device, source = group_device(group, near), dist.get_global_rank(group or dist.group.WORLD, 0)
    with torch.no_grad():
        for same in by_dtype(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in same]).to(device)
            dist.broadcast(flat, src=source, group=group)
            for tensor, value in zip(same, flat.split([t.numel() for t in same])):
                tensor.copy_(value.view_as(tensor))
