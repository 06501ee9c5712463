"""The engine's state in checkpoints: `state_dict(model)` / `load_state_dict(model, state)`.

What a lossy codec keeps between steps (residuals, randomk's rounds, PowerSGD's factors, the
autotuner's choice) is part of the training trajectory: a job that restarts without it does not
resume where it stopped. Under `trainaccel.init()` the model's own `state_dict()` carries it (in
the state dict's metadata, so every strict load still matches) and `load_state_dict()` on the
model, or on its module before DDP wraps it, brings it back.

Residuals are this rank's own: a checkpoint saved on rank 0 alone restores them on rank 0 only,
and the other ranks start theirs empty (they say so once). Save on every rank for an exact resume.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainaccel.comm.autotune import Autotuner
from trainaccel.comm.buckets import LOCAL_STORES, bucket_stores, park_all, split_key
from trainaccel.comm.hooks import CommState
from trainaccel.comm.momentum import restore_moved
from trainaccel.comm.powersgd import START_STEP
from trainaccel.context import current_config, info_once, warn_once
from trainaccel.environment import env_rank, env_world_size
from trainaccel.observer import StepObserver, observed, observer_of

FORMAT = 1
METADATA_KEY = "trainaccel_comm"  # in the metadata of the DDP model's module, next to torch's "version"
# module (the DDP model's, or one not wrapped yet) -> engine state loaded before the hook was registered
_pending: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def state_dict(ddp_model: torch.nn.Module) -> dict[str, Any]:
    """This rank's engine state for a DDP model ({} when the engine keeps none): pass it to `load_state_dict`.

    Tensors are the live ones, as in a model's `state_dict()`: save or copy it before training on.
    """
    state = _comm(ddp_model)
    diloco = _diloco(ddp_model)
    if state is None and diloco is None:  # loaded, not applied yet: kept as it came
        return dict(_pending_for(ddp_model) or {})
    if getattr(state, "builtin", False):
        return {}
    up = dist.is_initialized()  # a script may save after destroy_process_group(): the launcher's numbers then
    rank, world = (dist.get_rank(), dist.get_world_size()) if up else (env_rank(), env_world_size())
    header = {"format": FORMAT, "rank": rank, "world_size": world}
    if diloco is not None:
        return {**header, "diloco": diloco.state_dict()}
    if isinstance(state, Autotuner):
        saved = {c.label: _comm_state_dict(c.state) for c in state.candidates}
        return {
            **header,
            "autotune": {"chosen": state.chosen.label if state.chosen is not None else None, "candidates": saved},
        }
    return {**header, **_comm_state_dict(state)}


def load_state_dict(ddp_model: torch.nn.Module, saved: dict[str, Any]) -> None:
    """Restore what `state_dict` returned; before the hook is registered it waits for it (zero-code mode)."""
    if not saved:
        return
    if saved.get("format") != FORMAT:
        raise ValueError(f"trainaccel.comm state of format {saved.get('format')!r}; this version reads format {FORMAT}")
    state = _comm(ddp_model)
    diloco = _diloco(ddp_model)
    if state is None and diloco is None:
        _pending[_module(ddp_model)] = saved
        return
    if diloco is not None or "diloco" in saved:
        if diloco is None or "diloco" not in saved:
            now, then = ("sync_every", "a per-step exchange")
            if diloco is None:
                now, then = then, now
            warn_once(f"the checkpoint's communication state is for {then}, this run uses {now}: not restored")
            return
        # The same on every rank but the residuals, which are the saving rank's own.
        own = not saved["diloco"].get("residuals") or _local_part_applies(saved)
        diloco.load_state_dict(saved["diloco"], local=own)
        info_once(f"the checkpoint's sync_every state restored: inner step {saved['diloco']['steps']} and on")
        return
    local = _local_part_applies(saved)
    devices = {name: p.device for name, p in _module(ddp_model).named_parameters()}
    if isinstance(state, Autotuner):
        tuned = saved.get("autotune")
        if tuned is None:
            warn_once("the checkpoint's communication state is not an autotuner's (autotune was off): not restored")
            return
        by_label = {c.label: c for c in state.candidates}
        for label, candidate_saved in tuned["candidates"].items():
            if label in by_label:
                _load_comm_state(by_label[label].state, candidate_saved, local, devices)
        if tuned["chosen"] in by_label:
            state.chosen = by_label[tuned["chosen"]]
        return
    if "autotune" in saved:
        warn_once("the checkpoint's communication state is an autotuner's, and autotune is off now: not restored")
        return
    if not getattr(state, "builtin", False) and _load_comm_state(state, saved, local, devices):
        info_once(f"the checkpoint's {_compression(state)} state restored: step {saved['counters']['steps']} and on")


def attach(observer: StepObserver) -> None:
    """The model's own `state_dict()` carries the engine's state (idempotent); state loaded before the hook
    existed is restored once it does (call again after registering it)."""
    model = observer.model()
    if _save not in observer.subscribers("state_dict"):
        observer.subscribe("state_dict", _save)
    if observer.comm is not None or observer.diloco is not None:
        # Loaded into the module before DDP wrapped it: into it, or into a module it wraps (a LightningModule).
        found = [_pending.pop(ref(), None) for ref in observer.chain if ref() is not None]
        saved = next((s for s in found if s), None)
        if saved:
            load_state_dict(model, saved)


def _save(observer: StepObserver, destination: dict, prefix: str, local_metadata: dict) -> None:
    model = observer.model()
    if model is None:
        # The DDP model is gone, its engine state is not: Lightning drops the DDP model at the end of fit(), and a
        # script then saves the last checkpoint. A module it wrapped still finds the state.
        model = next((m for m in (ref() for ref in observer.chain) if m is not None), None)
    saved = state_dict(model) if model is not None else {}
    if saved:
        local_metadata[METADATA_KEY] = saved


def _comm(model: torch.nn.Module) -> Any:
    observer = observer_of(model)
    return observer.comm if observer is not None else None


def restoring_load_state_dict(original: Any) -> Any:
    """`Module.load_state_dict` that also keeps the engine state a state dict's metadata carries, for its module."""

    @functools.wraps(original)
    def load(self: torch.nn.Module, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, state_dict, *args, **kwargs)
        found = False
        for path, metadata in (getattr(state_dict, "_metadata", None) or {}).items():
            saved = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
            if saved:
                found = found or _after_a_step(saved)
                load_state_dict(_ddp_of(_saved_at(self, path)), saved)
        if not found:
            _say_what_starts_anew(self)
        return result

    return load


def _saved_at(module: torch.nn.Module, path: str) -> torch.nn.Module:
    """The submodule of `module` that the state saved at `path` belongs to. The keys may have been renamed since the
    save while the metadata kept its paths: a compiled module's `_orig_mod.` or DDP's `module.` stripped (nanoGPT's
    resume), so `path` names wrappers this module lacks. Its leading parts are dropped until the rest names a
    submodule; the module itself, at the end."""
    parts = path.split(".") if path else []
    while parts:
        try:
            return module.get_submodule(".".join(parts))
        except AttributeError:
            parts.pop(0)
    return module


def _after_a_step(saved: dict[str, Any]) -> bool:
    """Whether an engine state was saved after the model's first step. One from before it holds nothing a resume
    needs, and is what the state dict that `torch.distributed.checkpoint.load` fills in place carries when it was
    built from the fresh model (`{"model": model.state_dict()}`): the checkpoint itself kept tensors only."""
    if "diloco" in saved:
        return saved["diloco"].get("steps", 0) > 0
    if "autotune" in saved:
        return any(_after_a_step(c) for c in saved["autotune"]["candidates"].values())
    return saved.get("counters", {}).get("steps", 0) > 0


def _say_what_starts_anew(module: torch.nn.Module) -> None:
    """A state dict without the engine's state (safetensors, torch.distributed.checkpoint, save_pretrained keep
    tensors only) loaded into a model trained under `init()` with engine state: say once what a resume loses."""
    observer = observer_of(module)
    if observer is not None and module not in [observer.model(), *(ref() for ref in observer.chain)]:
        return  # a submodule's own load (pretrained weights for one layer): not a resume
    if observer is None and observed():
        return  # the model is wrapped already: this is another module (an EMA's copy), not the model resuming
    say_what_starts_anew(
        "load_state_dict: this state dict carries no trainaccel engine state (a writer that keeps tensors only, "
        "such as safetensors, torch.distributed.checkpoint or save_pretrained)"
    )


def say_what_starts_anew(what: str) -> None:
    """Under `init()` with engine state, say once that `what` (weights loaded without it) starts that state anew."""
    config = current_config()
    if config is None:
        return  # the explicit APIs' users hold their engine state themselves
    lost = []
    if config.sync_every:
        if config.outer_optimizer != "average":
            lost.append("sync_every's outer momentum")
        if config.outer_compression != "none":
            lost.append(f"{config.outer_compression}'s residuals (what it has not sent yet)")
        lost.append("the sync schedule (the next sync comes sync_every steps after the load)")
    elif config.compression == "powersgd":
        lost.append("powersgd's residuals and low-rank factors")
        lost.append(f"its step count (its {max(START_STEP, config.compression_warmup)} exact warm-up steps run again)")
    elif config.compression in ("topk", "randomk"):
        lost.append(f"{config.compression}'s residuals (what it has not sent yet)")
        if config.compression_warmup:
            lost.append(f"the step count (its {config.compression_warmup} exact warm-up steps run again)")
    elif config.compression != "none":
        lost.append(f"{config.compression}'s residuals (what it has not sent yet)")
    if lost:
        listed = lost[0] if len(lost) == 1 else f"{', '.join(lost[:-1])} and {lost[-1]}"
        verb = "starts" if len(lost) == 1 else "start"
        keep = "it" if len(lost) == 1 else "them"
        warn_once(
            f"{what}: if it resumes a run, {listed} {verb} anew; save `trainaccel.comm.state_dict(model)` beside it "
            f"to keep {keep}"
        )


def _diloco(model: torch.nn.Module) -> Any:
    observer = observer_of(model)
    return observer.diloco if observer is not None else None


def _pending_for(model: torch.nn.Module) -> dict[str, Any] | None:
    """Engine state loaded for `model` and not applied yet: loaded into its module, or into a module that one wraps
    (Lightning's LightningModule, inside the module DDP wraps), where `attach` will find it."""
    observer = observer_of(model)
    modules = [ref() for ref in observer.chain] if observer is not None else [_module(model)]
    return next((_pending[m] for m in modules if m is not None and m in _pending), None)


def _module(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _ddp_of(module: torch.nn.Module) -> torch.nn.Module:
    """The DDP model wrapping `module` if it already has engine state, else `module` (restored when wrapped)."""
    observer = observer_of(module)
    owner = observer.model() if observer is not None else None
    return owner if owner is not None else module


def _local_part_applies(saved: dict[str, Any]) -> bool:
    """Whether the checkpoint's residuals are this rank's (saved by this rank, in a job of this size)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if saved.get("rank") == rank and saved.get("world_size") == world:
        return True
    why = (
        f"it was saved by rank {saved.get('rank')}"
        if saved.get("world_size") == world
        else f"it was saved in a job of {saved.get('world_size')} workers, this one has {world}"
    )
    warn_once(
        f"the checkpoint's communication state is not this rank's ({why}): this rank's residuals start "
        "empty, which costs a little of the compressed gradients' history; save the model on every rank "
        "for an exact resume",
        every_rank=True,
    )
    return False


def _comm_state_dict(state: CommState) -> dict[str, Any]:
    names = list(state.param_names.values())
    buckets: dict[tuple, dict] = {
        signature: {k: dict(v) for k, v in entries.items()} for signature, entries in state.parked.items()
    }
    at = {signature: index for index, signature in state.signatures.items()}
    at.update({signature: index for index, signature in state.restored_buckets.items()})
    for signature in at:
        buckets.setdefault(signature, {})
    for name, store in bucket_stores(state).items():
        for key, value in store.items():
            index, rest = split_key(key)
            signature = state.signatures.get(index)
            if signature is not None:
                buckets.setdefault(signature, {}).setdefault(name, {})[rest] = value
    saved: dict[str, Any] = {
        "compression": _compression(state),
        "hierarchical": state.hierarchy is not None,
        "counters": {
            "steps": state.reductions,
            "fallbacks": state.fallbacks,
            "skipped_steps": state.skipped_steps,
            "flat_bytes_sent": state.flat_bytes_sent,
        },
        "buckets": [
            {
                "params": [names[i] if i < len(names) else f"#{i}" for i in signature],
                "index": at.get(signature, -1),
                **{name: [[rest, _copy(value)] for rest, value in entries.items()] for name, entries in stores.items()},
            }
            for signature, stores in buckets.items()
        ],
    }
    if state.moved is not None and state.moved.momentum:
        # The optimizer's momentum and weight decay, applied by the engine: the optimizer's own
        # state_dict() reports the script's settings, so a resumed job needs these from here.
        by_id = state.param_names
        saved["moved_momentum"] = {
            **state.moved.settings(),
            "weight_decay": {by_id[i]: decay for i, decay in state.moved.weight_decay.items() if i in by_id},
        }
    if state.hierarchy is not None:
        saved["counters"]["hierarchy_bytes_sent"] = state.hierarchy.bytes_sent
        saved["counters"]["intra_bytes_sent"] = state.hierarchy.intra_bytes_sent
    if state.powersgd is not None:
        p = state.powersgd
        kind, key, pos, has_gauss, cached = p.rng.get_state()
        saved["powersgd"] = {
            "iter": p.iter,
            "rng": [kind, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, cached],
            "total_numel_before_compression": p.total_numel_before_compression,
            "total_numel_after_compression": p.total_numel_after_compression,
        }
    return saved


def _load_comm_state(
    state: CommState, saved: dict[str, Any], local: bool, devices: dict[str, torch.device] | None = None
) -> bool:
    """Restore `saved` into `state` (False: not restored, and said why); each bucket's tensors go to the device of its
    parameters (`devices`, by name).

    A checkpoint keeps tensors where they were saved, and the usual recipe loads it with `map_location="cpu"`: a
    residual left there would meet a CUDA gradient at the first step. Moving them here, once, when the model's
    parameters are where they train, keeps the per-step path free of device checks and copies."""
    if saved.get("compression") != _compression(state) or saved.get("hierarchical") != (state.hierarchy is not None):
        warn_once(
            f"the checkpoint's communication state is for compression={saved.get('compression')} "
            f"(hierarchical: {saved.get('hierarchical')}), this run uses compression={_compression(state)} "
            f"(hierarchical: {state.hierarchy is not None}): not restored"
        )
        return False
    counters = saved["counters"]
    state.reductions = state.reductions_at_start = counters["steps"]
    state.fallbacks, state.skipped_steps = counters["fallbacks"], counters["skipped_steps"]
    state.flat_bytes_sent = counters["flat_bytes_sent"]
    if state.hierarchy is not None:
        state.hierarchy.bytes_sent = counters.get("hierarchy_bytes_sent", 0)
        state.hierarchy.intra_bytes_sent = counters.get("intra_bytes_sent", 0)
    if state.powersgd is not None and "powersgd" in saved:
        p, s = state.powersgd, saved["powersgd"]
        p.iter = s["iter"]
        p.total_numel_before_compression = s["total_numel_before_compression"]
        p.total_numel_after_compression = s["total_numel_after_compression"]
        kind, key, pos, has_gauss, cached = s["rng"]  # numpy's generator: its key belongs on the host
        p.rng.set_state((kind, key.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    if state.moved is not None and "moved_momentum" in saved:
        restore_moved(state, saved["moved_momentum"])
    # Whatever the engine held goes; the checkpoint's buckets wait, parked, for the indices DDP gives them.
    park_all(state)
    state.parked.clear()
    state.restored_buckets.clear()
    index_of = _index_of_saved_names(
        {name: i for i, name in enumerate(state.param_names.values())},
        [name for bucket in saved["buckets"] for name in bucket["params"]],
    )
    unknown = []
    for bucket in saved["buckets"]:
        params = bucket["params"]
        if not all(name in index_of for name in params):
            unknown.extend(name for name in params if name not in index_of)
            continue
        device = (devices or {}).get(params[0]) if params else None
        entries = {
            name: {rest: _on(value, device) for rest, value in pairs}
            for name, pairs in bucket.items()
            if name not in ("params", "index") and (local or name not in LOCAL_STORES)
        }
        signature = tuple(index_of[name] for name in params)
        state.parked[signature] = entries
        if bucket["index"] >= 0:
            state.restored_buckets[bucket["index"]] = signature
    if unknown:
        warn_once(
            f"the checkpoint's communication state names parameters this model does not have "
            f"({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}): their buckets start empty"
        )
    return True


# Wrappers whose attribute holds the module they wrap: their names in a parameter's path say nothing of the parameter.
_WRAPPERS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _index_of_saved_names(index_of: dict[str, int], saved: list[str]) -> dict[str, int]:
    """`index_of` (this model's parameter names) extended to the names a checkpoint saved them under, where the model
    was wrapped or renamed since: the same name without wrappers' parts (`_orig_mod.`, `module.`), else the one name
    of this model that ends with the saved one or that it ends with (a prefix added or stripped)."""

    def bare(name: str) -> str:
        return ".".join(part for part in name.split(".") if part not in _WRAPPERS)

    by_bare: dict[str, list[int]] = {}
    for name, index in index_of.items():
        by_bare.setdefault(bare(name), []).append(index)
    found = dict(index_of)
    for name in saved:
        if name in found:
            continue
        key = bare(name)
        matches = by_bare.get(key) or [
            i for b, ids in by_bare.items() for i in ids if b.endswith("." + key) or key.endswith("." + b)
        ]
        if len(matches) == 1:
            found[name] = matches[0]
    return found


def _compression(state: CommState) -> str:
    return "powersgd" if state.powersgd is not None else state.codec.name


def _on(value: Any, device: torch.device | None) -> Any:
    """A restored store's value on `device` (its bucket's parameters'): tensors moved, plain values as they are."""
    if isinstance(value, torch.Tensor) and device is not None and value.device != device:
        return value.to(device)
    return value


def _copy(value: Any) -> Any:
    """Lists (randomk's round) are copied, tensors kept live as a model's state_dict() keeps them."""
    return list(value) if isinstance(value, list) else value
