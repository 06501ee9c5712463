"""Zero-code mixed precision: every DDP model's forward under autocast (`amp=bf16|fp16|on`).

With `amp_policy` other than `always`, a per-step `PrecisionPolicy` decides from what this
module observes of the training loop: optimizer steps and learning rate (a global optimizer
hook) and the loss (the scalar that `.backward()` is called on). fp16 needs loss scaling:
`trainaccel.amp.scaled(optimizer)` is the one line that adds it.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map

from trainaccel.amp.policy import PrecisionPolicy, zero_code_policy
from trainaccel.config import Config
from trainaccel.context import is_rank_zero, warn_once

log = logging.getLogger("trainaccel")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(amp: str, device_type: str) -> torch.dtype | None:
    """The autocast dtype for option `amp` on this device; None when `amp` is off."""
    if amp == "off":
        return None
    if amp == "on":
        return torch.float16 if device_type == "cuda" else torch.bfloat16
    return _DTYPES[amp]


@dataclass
class _Observed:
    """What zero-code AMP sees of the training loop, shared by every model in the process."""

    steps: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)  # optimizer -> steps
    lr: float | None = None  # of the optimizer that stepped last
    loss: torch.Tensor | None = None  # the last scalar backward() was called on
    scaler: torch.amp.GradScaler | None = None
    scaled: bool = False  # a scaled loss was backpropagated since the last optimizer step
    update_due: bool = False  # the scaler stepped an optimizer: update it before the next iteration
    in_scaler_step: bool = False
    hooks: list[Any] = field(default_factory=list)

    @property
    def step(self) -> int:
        return max(self.steps.values(), default=0)

    def update_scaler(self) -> None:
        """`GradScaler.update()` once per iteration, after every scaled optimizer has stepped."""
        if self.update_due:
            self.scaler.update()
            self.update_due = self.scaled = False


_observed = _Observed()


@dataclass
class AmpState:
    """Zero-code AMP on one DDP model: `model.trainaccel_amp`."""

    dtype: torch.dtype
    device_type: str
    policy: PrecisionPolicy | None = None
    forwards: int = 0
    autocast_forwards: int = 0
    decided_at: int | None = None  # the step the policy last decided at

    def decide(self, training: bool) -> bool:
        if self.policy is None:
            return True
        step = _observed.step
        if training and step != self.decided_at:
            before = self.policy.decision if self.decided_at is not None else None
            self.decided_at = step
            self.policy.enabled(step=step, lr=_observed.lr, loss=_observed.loss, scaler=_observed.scaler)
            if self.policy.decision != before and is_rank_zero():
                if self.policy.decision:
                    log.info("amp: autocast from step %d", step)
                else:
                    log.info("amp: full precision from step %d (%s)", step, self.policy.reason)
        return self.policy.decision


def enable_amp(ddp_model: DistributedDataParallel, config: Config) -> AmpState | None:
    """Run `ddp_model`'s forward under autocast as `config` says; its floating outputs come back float32."""
    device_type = next(ddp_model.parameters()).device.type
    dtype = autocast_dtype(config.amp, device_type)
    if dtype is None or hasattr(ddp_model, "trainaccel_amp"):
        return getattr(ddp_model, "trainaccel_amp", None)
    policy = None if config.amp_policy == "always" else zero_code_policy(config.amp_policy)
    state = AmpState(dtype, device_type, policy)
    if device_type == "cpu" and not native_cpu_support(dtype):
        warn_once(f"amp={config.amp}: this CPU has no native {dtype} matrix instructions (AVX512-BF16 or AMX); "
                   "autocast on it is likely slower than float32 (see docs/BENCHMARKS.md)")  # fmt: skip
    if policy is not None:
        _observe_training_loop()
    forward = ddp_model.forward
    before_forward = _before_forward
    if config.compile == "on" or "torch._dynamo" in sys.modules:
        # Untraced: the step and the policy's memory change every step, and a compiled frame would
        # be specialised (and recompiled) on them; only the bool goes in. Importing TorchDynamo
        # just for this would slow every start, so runs that do not compile skip it.
        before_forward = torch.compiler.disable(_before_forward)

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        enabled = before_forward(state, ddp_model.training)
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            output = forward(*args, **kwargs)
        # The loss is computed outside the model, where autocast would have run it in float32.
        return tree_map(_to_float32, output) if enabled else output

    ddp_model.forward = autocast_forward
    ddp_model.trainaccel_amp = state
    return state


def _before_forward(state: AmpState, training: bool) -> bool:
    """Bookkeeping before a forward: the deferred scaler update, the decision, the fp16 check."""
    _observed.update_scaler()
    enabled = state.decide(training)
    if enabled and state.dtype == torch.float16 and _observed.scaler is None and training and torch.is_grad_enabled():
        raise RuntimeError(
            "amp=fp16 needs loss scaling, or small gradients underflow to zero: add "
            "`optimizer = trainaccel.amp.scaled(optimizer)` after building the optimizer (or use amp=bf16)"
        )
    state.forwards += 1
    state.autocast_forwards += enabled
    return enabled


def native_cpu_support(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices in hardware (else oneDNN emulates it, slowly)."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
    return cpu._is_amx_fp16_supported()


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


def scaled(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None) -> torch.optim.Optimizer:
    """The one line `amp=fp16` needs: losses are scaled and `optimizer` steps through a GradScaler.

    A no-op (returns `optimizer` as is) unless trainaccel autocasts in float16 on the optimizer's
    device, so a script can keep the line under any `--amp`. Call it before training; the
    optimizer keeps its identity (schedulers and checkpoints see the same object).
    """
    from trainaccel.runtime import current_config

    config = current_config()
    device_type = next((p.device.type for g in optimizer.param_groups for p in g["params"]), "cpu")
    if config is None or autocast_dtype(config.amp, device_type) != torch.float16:
        return optimizer
    if getattr(optimizer, "trainaccel_scaler", None) is not None:
        return optimizer
    if _observed.scaler is None:
        _observed.scaler = scaler or torch.amp.GradScaler(device_type)
    elif scaler is not None and scaler is not _observed.scaler:
        raise ValueError("every optimizer shares one GradScaler (the loss is scaled once): pass the same scaler or none")
    _observe_training_loop()
    original_step = optimizer.step

    @functools.wraps(original_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        if _observed.in_scaler_step or not _observed.scaled:
            return original_step(*args, **kwargs)  # GradScaler calling back, or gradients not scaled
        _observed.in_scaler_step = True
        try:
            result = _observed.scaler.step(optimizer, *args, **kwargs)
        finally:
            _observed.in_scaler_step = False
        _observed.update_due = True
        return result

    optimizer.step = step
    optimizer.trainaccel_scaler = _observed.scaler
    return optimizer


def _observe_training_loop() -> None:
    """Count optimizer steps, note the learning rate and the loss (and scale it under `scaled`); once."""
    if _observed.hooks:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _observed.scaled and not _observed.in_scaler_step:
            raise RuntimeError(
                f"the gradients are loss-scaled (amp=fp16) but this {type(optimizer).__name__} would step on them "
                "unscaled: pass every optimizer to trainaccel.amp.scaled() before training"
            )

    def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        _observed.steps[optimizer] = _observed.steps.get(optimizer, 0) + 1
        _observed.lr = float(optimizer.param_groups[0]["lr"])

    original_backward = torch.Tensor.backward

    @functools.wraps(original_backward)
    def backward(self: torch.Tensor, gradient: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if gradient is None and self.numel() == 1:
            _observed.loss = self.detach()
            if _observed.scaler is not None:
                _observed.update_scaler()
                _observed.scaled = True
                self = _observed.scaler.scale(self)
        return original_backward(self, gradient, *args, **kwargs)

    torch.Tensor.backward = backward
    hooks = [register_optimizer_step_pre_hook(before_step), register_optimizer_step_post_hook(after_step)]
    _observed.hooks = [*hooks, original_backward]


def reset() -> None:
    """Forget every observation and undo the global hooks (tests, and a fresh `init()` in one process)."""
    global _observed
    if _observed.hooks:
        *handles, original_backward = _observed.hooks
        for handle in handles:
            handle.remove()
        torch.Tensor.backward = original_backward
    _observed = _Observed()
