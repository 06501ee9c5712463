"""trainaccel's codecs on the cross-node reduction of a model sharded within each node (FSDP2, HSDP-style).

`register_fsdp(model, group)` takes a model whose parameters are sharded over the ranks of one node (a 1-D mesh)
and makes every block's reduced gradient shard, after FSDP2's reduce-scatter within the node, summed across the
replicas in `group` through a codec (fp16 or bf16) with error feedback. A sum that is not finite is reduced again
exactly, on every rank alike, as in the DDP hook. FSDP2 averages within the node; this divides by the replicas.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.distributed as dist

from trainaccel.comm.codecs import ErrorFeedback, get_codec
from trainaccel.comm.exchange import say_fallback, start_exchange
from trainaccel.config import Config
from trainaccel.context import info_once

CODECS = ("none", "fp16", "bf16")
_states: weakref.WeakKeyDictionary[torch.nn.Module, FSDPCommState] = weakref.WeakKeyDictionary()


class FSDPCommState:
    """What `register_fsdp` keeps for one model's cross-node reductions."""

    __slots__ = {
        "codec": "the codec of the cross-node sum (NoCompression, or a CastCompression with its dynamic scales)",
        "feedback": "error feedback per block (None for an exact codec): what the cast dropped, sent next step",
        "group": "the ranks holding the same shard on the other nodes (one per node)",
        "bytes_sent": "bytes this rank received from cross-node sums so far",
        "reductions": "cross-node sums done so far (one per block per backward)",
        "fallbacks": "sums redone exactly because the codec's sum was not finite",
    }

    def __init__(self, codec: Any, feedback: ErrorFeedback | None, group: dist.ProcessGroup):
        self.codec, self.feedback, self.group = codec, feedback, group
        self.bytes_sent = self.reductions = self.fallbacks = 0


def register_fsdp(model: torch.nn.Module, group: dist.ProcessGroup, config: Config | None = None, **options: Any):
    """Sum every block's gradient shard across `group` through `compression` (none, fp16, bf16); returns the state.

    `model` must be sharded with `fully_shard` on a 1-D mesh (within a node): a 2-D (HSDP) mesh already reduces
    across replicas in FSDP2 itself. Options are those of `Config` (compression, fp16_scale).
    """
    from torch.distributed.fsdp import FSDPModule

    if config is None:
        config = Config.resolve(**options)
    elif options:
        config = dataclasses.replace(config, **options)
    if config.compression not in CODECS:
        raise ValueError(
            f"invalid compression={config.compression!r} for a sharded model; accepted: {', '.join(CODECS)} "
            "(the reduced shard of each block is summed whole across nodes)"
        )
    meshes = {p.device_mesh.ndim for p in model.parameters() if hasattr(p, "device_mesh")}
    if meshes != {1}:
        found = "no sharded parameter" if not meshes else f"a {max(meshes)}-D mesh"
        raise ValueError(
            f"register_fsdp needs a model sharded with fully_shard on a 1-D mesh within a node; it has {found} "
            "(a 2-D mesh is reduced across replicas by FSDP2 itself)"
        )
    device = next((p.device for p in model.parameters()), None)
    codec = get_codec(config.compression, fp16_scale=config.fp16_scale, device=device)
    state = FSDPCommState(codec, ErrorFeedback() if codec.lossy else None, group)
    replicas = dist.get_world_size(group)
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(_reducer(state, name or "<root>", 1.0 / replicas))
    _states[model] = state
    info_once(f"sharded model: gradient shards summed across {replicas} replicas in {config.compression}")
    return state


def fsdp_state(model: torch.nn.Module) -> FSDPCommState | None:
    """The state `register_fsdp` gave this model, or None."""
    return _states.get(model)


def _reducer(state: FSDPCommState, key: str, scale: float):
    def reduce(shard: torch.Tensor) -> None:
        outcome = start_exchange(state.codec, state.feedback, shard, key, state.group, scale).finish()
        if outcome.result is not shard:
            shard.copy_(outcome.result)
        state.bytes_sent += outcome.sent
        state.reductions += 1
        if outcome.fallback is not None:
            state.fallbacks += 1
            say_fallback(state.codec.name, f"block {key}", outcome.fallback)

    return reduce
