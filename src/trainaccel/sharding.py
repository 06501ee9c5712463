"""`shard()`: a model sharded with FSDP2 (`fully_shard`) block by block, over every rank or within each node.

`full` shards every parameter over all ranks. `hybrid` shards within a node and replicates across
nodes (HSDP: a 2-D mesh, replicas across nodes, shards within one), so only gradient reductions
of whole replicas cross the slow link. Blocks are the submodules holding at least `min_params`
parameters not already in a smaller block, found bottom-up; the root takes the rest.
"""

from __future__ import annotations

import os
from typing import Any

MODES = ("full", "hybrid")
_SPARSE = ("Embedding", "EmbeddingBag")


class ShardError(ValueError):
    """The model cannot be sharded as asked; the message names the module or parameter and why."""


def _check_shardable(model: Any) -> None:
    """Refuse what FSDP2 cannot keep: sparse gradients, and parameters that are not leaves of one module."""
    for name, module in model.named_modules():
        if type(module).__name__ in _SPARSE and getattr(module, "sparse", False):
            raise ShardError(
                f"cannot shard {name or type(model).__name__}: {type(module).__name__}(sparse=True) makes sparse "
                "gradients, which sharded parameters do not take; use sparse=False, or keep this model under DDP "
                "(trainaccel's sharded embeddings: trainaccel.embedding)"
            )


def blocks(model: Any, min_params: int) -> list[tuple[str, Any]]:
    """The submodules to shard on their own, bottom-up: each holds >= `min_params` parameters no smaller block took.

    A parameter shared by two blocks cannot be sharded twice: the message names it and both owners.
    """
    owners: dict[int, str] = {}  # parameter id -> the block that took it
    chosen: list[tuple[str, Any]] = []

    def visit(name: str, module: Any) -> int:
        free = 0
        for child_name, child in module.named_children():
            free += visit(f"{name}.{child_name}" if name else child_name, child)
        own = [p for p in module.parameters(recurse=False)]
        free += sum(p.numel() for p in own if id(p) not in owners)
        if name and free >= min_params:
            taken = [p for p in module.parameters() if id(p) not in owners]
            for parameter in taken:
                owners[id(parameter)] = name
            chosen.append((name, module))
            return 0
        return free

    visit("", model)
    # Tied parameters: reachable from a block and from outside it (another block, or the root's own modules).
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owner = owners.get(id(parameter))
        if owner is not None and not (name == owner or name.startswith(f"{owner}.")):
            raise ShardError(
                f"cannot shard {owner!r} on its own: its parameter is also {name!r} (tied); raise min_params so "
                "that one block holds both, or untie them"
            )
    return chosen


def device_mesh(mode: str, process_group_backend: str | None = None) -> Any:
    """The mesh for `mode`: 1-D over every rank (`full`), or (nodes, ranks per node) named replicate, shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if mode not in MODES:
        raise ValueError(f"invalid mode={mode!r}; accepted: {', '.join(MODES)}")
    if not dist.is_initialized():
        raise RuntimeError("shard() needs the default process group: call dist.init_process_group() or init() first")
    backend = process_group_backend or dist.get_backend()
    device = "cuda" if "nccl" in str(backend) else "cpu"
    world = dist.get_world_size()
    if mode == "full":
        return init_device_mesh(device, (world,), mesh_dim_names=("shard",))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        raise ShardError(
            f"hybrid sharding needs nodes of equal size: world {world}, {per_node} ranks on this node "
            "(LOCAL_WORLD_SIZE); use mode='full'"
        )
    return init_device_mesh(device, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def shard(
    model: Any,
    mode: str = "full",
    *,
    mesh: Any = None,
    min_params: int = 1_000_000,
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
) -> Any:
    """Shard `model` in place with `fully_shard`, block by block then the root; returns it (now an FSDP module).

    `mesh` overrides the one `mode` makes; `mp_policy` is FSDP2's MixedPrecisionPolicy.
    """
    from torch.distributed.fsdp import fully_shard

    if mode not in MODES:
        raise ValueError(f"invalid mode={mode!r}; accepted: {', '.join(MODES)}")
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise ValueError(f"invalid min_params={min_params!r}; accepted: an integer >= 1 (parameters per block)")
    _check_shardable(model)
    chosen = blocks(model, min_params)
    if mesh is None:
        mesh = device_mesh(mode)
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for _, module in chosen:
        fully_shard(module, **options)
    return fully_shard(model, **options)
