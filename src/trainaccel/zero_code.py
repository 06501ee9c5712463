"""Zero-code mode: what `init()` adds to each DDP model built after it (AMP, metrics, sync_every, compile, the
communication hook), composed above the modules that implement them."""

from __future__ import annotations

import functools
import inspect
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as ddp_module
from torch.nn.parallel import DistributedDataParallel

from trainaccel import context
from trainaccel.amp.ddp import enable_amp
from trainaccel.comm import checkpoint, diloco
from trainaccel.comm.auto_setting import Broadcast
from trainaccel.comm.ddp import register
from trainaccel.comm.exit_guard import guard_exit
from trainaccel.config import Config
from trainaccel.context import log, warn_once
from trainaccel.environment import env_world_size
from trainaccel.monitor.ddp import attach_meter
from trainaccel.observer import StepObserver, observe, observer_of, watch_optimizer_steps, wrapper_chain
from trainaccel.resilience import failfast


def patch_ddp(config: Config) -> None:
    """Every DDP model constructed from now on gets what `config` asks for (idempotent; undone by shutdown)."""
    context.set_config(config)
    if config.sync_every:
        diloco.record_optimizers()  # before the script builds its optimizers: a model's inner step waits for each
    if not context.first_time("DDP patch"):
        return
    watch_optimizer_steps(after=_say_if_nothing_took_the_options)
    context.on_undo("optimizer steps counted", _steps_untaken.clear)
    # A checkpoint is often loaded into the module before DDP wraps it: keep its engine state for the wrap.
    original_load = torch.nn.Module.load_state_dict
    context.patch(torch.nn.Module, "load_state_dict", checkpoint.restoring_load_state_dict(original_load))
    original = DistributedDataParallel.__init__
    signature = inspect.signature(original)
    broadcasts = _time_wrap_broadcasts()

    @functools.wraps(original)
    def __init__(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        config = context.current_config()
        bound = signature.bind_partial(self, *args, **kwargs).arguments if config is not None else {}
        if config is not None and config.bucket_mb is not None:
            if bound.get("bucket_cap_mb") is None and not bound.get("bucket_cap_mb_list"):
                kwargs["bucket_cap_mb"] = config.bucket_mb
        broadcasts.clear()
        original(self, *args, **kwargs)
        if config is not None:
            # What DDP broadcast as it built the model: nothing under init_sync=False, or where it returned early.
            accelerate(self, config, broadcast=broadcasts.pop(id(self.module), None))
        broadcasts.clear()

    context.patch(DistributedDataParallel, "__init__", __init__)


def _time_wrap_broadcasts() -> dict[int, Broadcast]:
    """Time the broadcast of rank 0's model DDP makes as it wraps one (`_sync_module_states`); returns where each
    lands: id(module) -> `Broadcast`. sync_every=auto measures the link by it instead of a sync of its own."""
    timed: dict[int, Broadcast] = {}
    original = ddp_module._sync_module_states
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _sync_module_states(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        original(*args, **kwargs)
        seconds = time.perf_counter() - start
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        module, ignored = arguments["module"], arguments["params_and_buffers_to_ignore"]
        states = [*module.named_parameters(), *(module.named_buffers() if arguments["broadcast_buffers"] else ())]
        nbytes = sum(t.numel() * t.element_size() for name, t in states if name not in ignored)
        sent = dist.get_rank(arguments["process_group"]) == arguments["src"]
        timed[id(module)] = Broadcast(seconds, nbytes, sent)

    context.patch(ddp_module, "_sync_module_states", _sync_module_states)
    return timed


def accelerate(ddp_model: DistributedDataParallel, config: Config, broadcast: Broadcast | None = None) -> StepObserver:
    """What `init()` adds to a DDP model just built: its observer, then AMP, metrics, and the hook at the first step.
    `broadcast`: DDP's broadcast of rank 0's parameters as it built the model (its `init_sync`), timed."""
    observer = observe(ddp_model, compiled=config.compile == "on")
    _note_pretrained(ddp_model)
    if config.sync_every:
        # No gradient exchange: the hook registered at the first step is not needed.
        diloco.attach(ddp_model, config, broadcast)
    elif config.on_lost_replica == "continue" and failfast.incarnation() > 0:
        register(ddp_model, config)  # a replica started again rejoins as DDP wraps its model: before the loop
    checkpoint.attach(observer)  # before the hook exists: a checkpoint loaded now waits for it
    if config.amp != "off":
        enable_amp(observer, config)
    if config.metrics_every:
        attach_meter(observer, config)
    if hasattr(ddp_model, "reducer"):
        # Registered at the first forward, so a script that registers its own hook after
        # building the model keeps it (DDP accepts only one hook per model).
        unsubscribe = None

        def at_first_step(observer: StepObserver, args: tuple, kwargs: dict) -> None:
            unsubscribe()
            _register_at_first_step(ddp_model, config)

        unsubscribe = observer.subscribe("step_begin", at_first_step)
    return observer


def _note_pretrained(ddp_model: DistributedDataParallel) -> None:
    """A model of transformers' `from_pretrained(folder)` (a run's own `save_pretrained`, perhaps): transformers
    assigns the weights itself, no `load_state_dict` is seen, and the folder keeps tensors only."""
    for module in wrapper_chain(ddp_model.module):
        source = getattr(module, "name_or_path", None)  # what from_pretrained was given
        if isinstance(source, str) and source and os.path.isdir(source):
            checkpoint.say_what_starts_anew(
                f"DDP wraps a model loaded by from_pretrained({source!r}): the folder carries no trainaccel engine "
                "state (save_pretrained keeps tensors only)"
            )
            return


def _register_at_first_step(ddp_model: DistributedDataParallel, config: Config) -> None:
    if config.compile == "on":
        # From the second step on: this first call registers hooks, which is no work for a compiler.
        from trainaccel.compiler import compile

        compile(ddp_model, config.compile_preset)
    if observer_of(ddp_model).diloco is not None:
        if config.straggler_every or config.timeline is not None:
            warn_once(
                f"straggler_every and timeline time the per-step gradient exchange, which sync_every="
                f"{config.sync_every} switches off: off for this model"
            )
        return
    if observer_of(ddp_model).survivors is not None:  # a replica started again: registered as DDP wrapped its model
        return
    existing = ddp_model._get_ddp_logging_data().get("comm_hook")
    if existing:
        log.info("keeping the communication hook %s registered by the script", existing)
        if config.straggler_every or config.timeline is not None:
            warn_once(
                "straggler_every and timeline need trainaccel's communication hook: off for this model, "
                f"which keeps the script's hook {existing}"
            )
        guard_exit()  # a Python hook of the script's is exposed to the same exit race as ours
        return
    if config.local_steps > 1 and observer_of(ddp_model).local_steps is None:
        warn_once(
            f"local_steps={config.local_steps} needs trainaccel.comm.LocalSteps(model, optimizer) in the script: "
            "without it this model reduces gradients at every backward pass (zero-code mode cannot hold back "
            "the script's optimizer steps)"
        )
    register(ddp_model, config)


# Options that act without a model: the rest do nothing until a DDP model (or a sharded one, a Horovod optimizer, the
# explicit API) takes them.
_PROCESS_OPTIONS = frozenset({"collective_timeout", "hang_timeout", "log_level"})
_STEPS_BEFORE_SAYING = 2  # optimizer steps with nothing taking the options: one may come before the model is wrapped
_steps_untaken: list[int] = []  # the optimizer steps counted so far (until shutdown), at most _STEPS_BEFORE_SAYING


def options_for_a_model(config: Config) -> list[str]:
    """`config`'s options set away from their defaults that only a model, or an optimizer, can take."""
    defaults = Config()
    return [
        f"{name}={getattr(config, name)}"
        for name in Config.option_names()
        if name not in _PROCESS_OPTIONS and getattr(config, name) != getattr(defaults, name)
    ]


def _say_if_nothing_took_the_options(optimizer: torch.optim.Optimizer) -> None:
    """In a job of several workers, optimizers stepping while nothing took the options: say so once (an Accelerate
    script without `cpu=True` on a machine without GPUs sees one worker and builds no DDP model)."""
    config = context.current_config()
    if config is None or context.taken() or len(_steps_untaken) >= _STEPS_BEFORE_SAYING:
        return
    _steps_untaken.append(id(optimizer))
    counted = len(_steps_untaken)
    if counted < _STEPS_BEFORE_SAYING:
        return
    world = dist.get_world_size() if dist.is_initialized() else env_world_size()  # the launcher's, without a group
    if world < 2 or context.rank() != 0:  # a fact of the whole job: rank 0 says it (the launcher's rank 0, groupless)
        return
    given = options_for_a_model(config)
    if given:
        warn_once(
            every_rank=True,
            message=f"{counted} optimizer steps ran in this job of {world} workers and no "
            f"DistributedDataParallel model, sharded model or hvd.DistributedOptimizer took {' '.join(given)}: not "
            "applied, and unless the script exchanges gradients itself each worker trains alone. Likely causes: the "
            "framework saw one worker and wrapped nothing (Accelerate on a machine without GPUs needs "
            "Accelerator(cpu=True)), or the model was wrapped in DDP before trainaccel.init()",
        )
