"""trainaccel's hook on a DDP model: `register` it, build its state, read its state and the bytes it sent."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainaccel.comm import checkpoint, momentum
from trainaccel.comm.autotune import Autotuner, Candidate, autotune_comm_hook, candidate_configs, warmup_steps
from trainaccel.comm.codecs import ErrorFeedback, NoCompression, get_codec
from trainaccel.comm.exchange import warn_if_gathering_costs_more
from trainaccel.comm.exit_guard import guard_exit
from trainaccel.comm.hierarchical import HierarchicalReduce
from trainaccel.comm.hooks import CommState, CommWait, trainaccel_comm_hook
from trainaccel.comm.powersgd import powersgd_state
from trainaccel.comm.scheduler import connect, engine_group
from trainaccel.comm.topology import discover, hierarchy_for
from trainaccel.config import Config
from trainaccel.context import info_once, warn_once
from trainaccel.monitor import timeline
from trainaccel.monitor.ddp import watch_steps
from trainaccel.observer import observe, observer_of
from trainaccel.resilience import failfast


def register(ddp_model: DistributedDataParallel, config: Config | None = None, **options: Any) -> CommState | Autotuner:
    """Register trainaccel's communication hook on a DDP model; returns the hook's state.

    Options are those of `Config` (keyword > TRAINACCEL_* env > default). Call it on every rank
    (finding the topology is collective). `bucket_mb` cannot change an existing model's buckets:
    pass `bucket_cap_mb` to DDP or use `trainaccel.init()`.
    """
    if config is None:
        config = Config.resolve(**options)
    elif options:
        config = dataclasses.replace(config, **options)
    if config.sync_every:
        raise ValueError(
            f"register() adds a per-step gradient exchange, and sync_every={config.sync_every} switches it off: "
            "use trainaccel.comm.DiLoCo(model, optimizer, sync_every=...) for low-communication training"
        )
    if config.on_lost_replica == "continue":
        from trainaccel.comm import survivors  # (it builds on the membership of the syncs)

        observe(ddp_model, compiled=config.compile == "on")
        failfast.start_heartbeat()
        return survivors.attach(ddp_model, config)
    delayed = getattr(ddp_model, "_delay_all_reduce_params", None)
    if delayed:
        # DDP all-reduces them from a hook of its own, outside the reducer a communication hook replaces.
        warn_once(
            f"DDP all-reduces the {len(delayed)} parameter(s) of delay_all_reduce_named_params itself, uncompressed "
            f"and unchecked: compression={config.compression}, nan_check={config.nan_check} and the hierarchy reach "
            "the others only"
        )
    param_names = {id(p): name for name, p in ddp_model.module.named_parameters()}
    # DDP's reducer then all-reduces its map of used parameters after every step's last bucket (see CommState).
    map_after_last = ddp_model.find_unused_parameters and not getattr(ddp_model, "static_graph", False)
    device = next((p.device for p in ddp_model.parameters() if p.requires_grad), None)  # where gradients are reduced
    observer = observe(ddp_model, compiled=config.compile == "on")
    failfast.start_heartbeat()
    # straggler_every and timeline are options of register() as well: they time the step around the hook's wait.
    if config.timeline is not None:
        timeline.start(config.timeline, dist.get_rank())
    comm_wait = CommWait() if config.straggler_every else None
    if config.straggler_every or config.timeline is not None:
        watch_steps(observer, config, comm_wait)
    if config.autotune == "on":
        if config.compression in momentum.SPARSE_CODECS and config.compression_momentum == "auto":
            warn_once(
                f"autotune=on: the {config.compression} candidates run without momentum correction (the optimizer "
                "keeps its momentum); set compression_momentum, or autotune=off, for it"
            )
        tuner = build_autotuner(ddp_model.process_group, config, param_names, comm_wait, device=device)
        for candidate in tuner.candidates:
            candidate.state.observer = observer
            candidate.state.ddp_collective_after_last = map_after_last
        ddp_model.register_comm_hook(tuner, autotune_comm_hook)
        connect(tuple(g for candidate in tuner.candidates for g in candidate.state.groups), device)
        observer.comm = tuner
        checkpoint.attach(observer)
        return tuner
    state = build_state(ddp_model.process_group, config, param_names, comm_wait, device=device)
    state.observer = observer
    state.ddp_collective_after_last = map_after_last
    momentum.attach(observer, state, config.compression, config.compression_momentum)
    if _nothing_to_add(state, config):
        # A Python hook costs a few percent over DDP's C++ allreduce; with nothing to add, use that.
        state.builtin = True
        state.dense_bytes_per_step = sum(
            p.numel() * p.element_size() for p in ddp_model.parameters() if p.requires_grad
        )
        ddp_model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        guard_exit()  # Gloo's threads can still be finishing at exit: the same short wait as for our hook
    else:
        ddp_model.register_comm_hook(state, trainaccel_comm_hook)
        connect(state.groups, device)  # the communicators the hook will use, built now on this thread
    observer.comm = state
    checkpoint.attach(observer)  # the model's state_dict() carries the engine's state; state loaded before applies
    return state


def _nothing_to_add(state: CommState, config: Config) -> bool:
    return (
        isinstance(state.codec, NoCompression)
        and state.hierarchy is None
        and state.powersgd is None
        and state.nan_check == "off"
        and state.comm_wait is None
        and config.timeline is None  # a timeline on rank 0 needs the hook on every rank: the same reduction
    )


def build_autotuner(
    process_group: Any,
    config: Config,
    param_names: dict[int, str],
    comm_wait: CommWait | None = None,
    *,
    device: torch.device | None = None,
) -> Autotuner:
    """An Autotuner over the candidate reductions for `config` (see `trainaccel.comm.autotune`)."""
    multi_node = config.hierarchical != "off" and discover(process_group).why_flat() is None
    candidates = []
    for label, candidate_config, chunk_mb in candidate_configs(config, multi_node):
        state = build_state(process_group, candidate_config, param_names, comm_wait, device=device)
        if chunk_mb is not None and state.hierarchy is not None:
            state.hierarchy.chunk_mb = chunk_mb
        candidates.append(Candidate(label, state, warmup_steps(candidate_config)))
    tuner = Autotuner(candidates, process_group)
    if tuner.chosen is not None:
        info_once(f"autotune: one candidate only ({tuner.chosen.label}), nothing to time")
    else:
        info_once(f"autotune: timing {len(candidates)} candidates: {', '.join(c.label for c in candidates)}")
    return tuner


DENSE_CODECS = ("none", "fp16", "bf16")
# hierarchical=auto turns the hierarchy on for Gloo only, where it was measured faster over emulated nodes
# (docs/results.md#one-replica-per-node-and-the-two-level-allreduce). NCCL's own rings and trees already follow the
# topology, and the two-level form was not measured against them: there `on`, or autotune=on, which times both.


def build_state(
    process_group: Any,
    config: Config,
    param_names: dict[int, str] | None = None,
    comm_wait: CommWait | None = None,
    *,
    device: torch.device | None = None,
) -> CommState:
    """The hook state `config` asks for: codec, error feedback, and the hierarchy if it applies (`device`: where the
    gradients live, which picks the backend of a group with one per device type; None: the CPU)."""
    state = CommState(
        process_group=process_group,
        codec=NoCompression(),
        group=engine_group(process_group),
        nan_check=config.nan_check,
        param_names=param_names or {},
        comm_wait=comm_wait,
        param_index={pid: i for i, pid in enumerate(param_names or {})},
    )
    if config.compression == "powersgd":
        state.powersgd = powersgd_state(state.group, config.powersgd_rank, start=config.compression_warmup)
        if config.hierarchical == "on":
            warn_once("hierarchical=on: powersgd reduces over all workers at once (its payload is already small)")
        return state
    state.codec = get_codec(
        config.compression,
        ratio=config.compression_ratio,
        fp16_scale=config.fp16_scale,
        ratio_max=config.compression_ratio_max,  # Config.resolve checked it is above the ratio
        device=device,
    )
    warn_if_gathering_costs_more(state.codec, dist.get_world_size(state.group), "gradient")
    if state.codec.lossy:
        sparse = config.compression in momentum.SPARSE_CODECS
        explicit = config.compression_momentum if sparse and config.compression_momentum != "auto" else 0.0
        state.feedback = ErrorFeedback(explicit)  # under auto, the optimizer's momentum comes at the warm-up's end
        state.warmup_steps = config.compression_warmup if sparse else 0
    dense = config.compression in DENSE_CODECS
    topology = hierarchy_for(process_group, config.hierarchical, dense, "reducing", device)
    if topology is not None:
        intra_codec = get_codec(config.intra_compression, fp16_scale=config.fp16_scale, device=device)
        intra_feedback = ErrorFeedback() if intra_codec.lossy else None
        state.hierarchy = HierarchicalReduce(topology, state.codec, state.feedback, intra_codec, intra_feedback)
        state.feedback = None  # the hierarchy applies it across nodes
        info_once(
            f"hierarchical allreduce: {topology.num_nodes} nodes x {topology.local_size} workers, "
            f"{config.compression} across nodes, {config.intra_compression} within"
        )
    if config.intra_compression != "none" and not state.hierarchical:
        warn_once(f"intra_compression={config.intra_compression} has no effect: the reduction is flat")
    return state


def comm_state(ddp_model: DistributedDataParallel) -> CommState | None:
    """The state of trainaccel's hook on this model, or None if it carries no trainaccel hook."""
    observer = observer_of(ddp_model)
    return observer.comm if observer is not None else None


def bytes_sent(ddp_model: DistributedDataParallel) -> int:
    """Bytes trainaccel's hook has counted on this model so far (0 when DDP's own allreduce runs)."""
    observer = observer_of(ddp_model)
    if observer is not None and observer.diloco is not None:
        return observer.diloco.bytes_sent
    if observer is not None and observer.survivors is not None:
        return observer.survivors.bytes_sent
    state = comm_state(ddp_model)
    return 0 if state is None or getattr(state, "builtin", False) else state.bytes_sent


def bytes_per_step(ddp_model: DistributedDataParallel, sent_before: int | None = None, steps: int = 0) -> float:
    """Allreduce payload per step for this model: measured by trainaccel's hook, else plain DDP's.

    With `sent_before` (a `bytes_sent` reading) and `steps`: over the steps since that reading,
    e.g. a benchmark's timed steps (a lossy codec reduces the first step exactly). Plain DDP (no
    hook, or a hook we did not build) reduces every gradient once per step, in its dtype.
    """
    observer = observer_of(ddp_model)
    if observer is not None and observer.diloco is not None:  # sync_every: what the syncs sent, per inner step
        diloco = observer.diloco
        if sent_before is not None and steps:
            return (diloco.bytes_sent - sent_before) / steps
        return diloco.bytes_sent / max(diloco.steps, 1)
    survivors = observer.survivors if observer is not None else None
    if survivors is not None:  # on_lost_replica=continue per step: what its exchanges sent
        if sent_before is not None and steps:
            return (survivors.bytes_sent - sent_before) / steps
        return survivors.bytes_per_step()
    state = comm_state(ddp_model)
    if state is not None and not getattr(state, "builtin", False):
        if sent_before is not None and steps:
            return (state.bytes_sent - sent_before) / steps
        return state.bytes_per_step()
    if state is not None:
        return state.bytes_per_step()
    return float(sum(p.numel() * p.element_size() for p in ddp_model.parameters() if p.requires_grad))
