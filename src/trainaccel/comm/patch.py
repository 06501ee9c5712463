"""Make DDP models use trainaccel's hook: explicitly with `register`, or for every model built after `init()`."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from trainaccel.comm.codecs import get_codec
from trainaccel.comm.hooks import CommState, guard_exit, trainaccel_comm_hook
from trainaccel.config import Config

log = logging.getLogger("trainaccel")

_original_init = None
_config: Config | None = None
_warned_hierarchical = False


def register(ddp_model: DistributedDataParallel, config: Config | None = None, **options: Any) -> CommState:
    """Register trainaccel's communication hook on a DDP model; returns the hook's state.

    Options are those of `Config` (keyword > TRAINACCEL_* env > default). `bucket_mb` cannot
    change an existing model's buckets: pass `bucket_cap_mb` to DDP or use `trainaccel.init()`.
    """
    global _warned_hierarchical
    if config is None:
        config = Config.resolve(**options)
    elif options:
        config = dataclasses.replace(config, **options)
    if config.hierarchical == "on" and not _warned_hierarchical:
        _warned_hierarchical = True
        log.warning("hierarchical=on: this version reduces flat over all ranks (hierarchy not yet available)")
    state = CommState(
        process_group=ddp_model.process_group,
        codec=get_codec(config.compression),
        nan_check=config.nan_check,
        param_names={id(p): name for name, p in ddp_model.module.named_parameters()},
    )
    ddp_model.register_comm_hook(state, trainaccel_comm_hook)
    ddp_model.trainaccel_state = state
    return state


def comm_state(ddp_model: DistributedDataParallel) -> CommState | None:
    """The state of trainaccel's hook on this model, or None if it carries no trainaccel hook."""
    return getattr(ddp_model, "trainaccel_state", None)


def bytes_per_step(ddp_model: DistributedDataParallel) -> float:
    """Allreduce payload per step for this model: measured by trainaccel's hook, else plain DDP's.

    Plain DDP (no hook, or a hook we did not build) reduces every gradient once per step, in its dtype.
    """
    state = comm_state(ddp_model)
    if state is not None:
        return state.bytes_per_step()
    return float(sum(p.numel() * p.element_size() for p in ddp_model.parameters() if p.requires_grad))


def patch_ddp(config: Config) -> None:
    """Every DDP model constructed from now on gets trainaccel's hook for `config` (idempotent)."""
    global _original_init, _config
    _config = config
    if _original_init is not None:
        return
    original = DistributedDataParallel.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        config = _config
        if config is not None and config.bucket_mb is not None:
            bound = signature.bind_partial(self, *args, **kwargs).arguments
            if bound.get("bucket_cap_mb") is None and not bound.get("bucket_cap_mb_list"):
                kwargs["bucket_cap_mb"] = config.bucket_mb
        original(self, *args, **kwargs)
        if config is not None and hasattr(self, "reducer"):
            # Registered at the first forward, so a script that registers its own hook after
            # building the model keeps it (DDP accepts only one hook per model).
            self._trainaccel_first_forward = self.register_forward_pre_hook(
                functools.partial(_register_at_first_forward, config=config)
            )

    DistributedDataParallel.__init__ = __init__
    _original_init = original


def unpatch_ddp() -> None:
    """Undo `patch_ddp`; models built afterwards are plain DDP again."""
    global _original_init, _config
    if _original_init is not None:
        DistributedDataParallel.__init__ = _original_init
    _original_init, _config = None, None


def _register_at_first_forward(ddp_model: DistributedDataParallel, inputs: Any, *, config: Config) -> None:
    ddp_model.__dict__.pop("_trainaccel_first_forward").remove()
    existing = ddp_model._get_ddp_logging_data().get("comm_hook")
    if existing:
        log.info("keeping the communication hook %s registered by the script", existing)
        guard_exit()  # a Python hook of the script's is exposed to the same exit race as ours
        return
    register(ddp_model, config)
