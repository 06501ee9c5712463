"""Zero-code mixed precision: every DDP model's forward under autocast (`amp=bf16|fp16|on`).

With `amp_policy` other than `always`, a per-step `PrecisionPolicy` decides from what this
module observes of the training loop: optimizer steps and learning rate (a global optimizer
hook) and the loss (the scalar that `.backward()` is called on). fp16 needs loss scaling:
`trainaccel.amp.scaled(optimizer)` is the one line that adds it; the script's gradient clipping
and learning-rate schedulers then work as they would without scaling.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import weakref
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

from trainaccel import context
from trainaccel.amp.policy import PrecisionPolicy, zero_code_policy
from trainaccel.config import Config
from trainaccel.context import info_once, speaks_for_job, warn_once
from trainaccel.observer import StepObserver, watch_backward, watch_optimizer_steps

log = logging.getLogger("trainaccel")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(amp: str, device: str | torch.device) -> torch.dtype | None:
    """The autocast dtype for option `amp` on `device` (a device or its type); None when `amp` is off.

    `on` is bfloat16 wherever it is computed natively: CPUs (as before) and GPUs that have it in hardware (CUDA
    compute capability 8.0 on: A100, H100, RTX 30xx on; ROCm). Only a GPU without it (V100, T4) gets float16, which
    needs loss scaling (`scaled`), as bfloat16, with float32's range, does not.
    """
    if amp == "off":
        return None
    if amp == "on":
        device = torch.device(device)
        return torch.float16 if device.type == "cuda" and not native_cuda_bf16(device) else torch.bfloat16
    return _DTYPES[amp]


def native_cuda_bf16(device: torch.device) -> bool:
    """Whether this CUDA device computes bfloat16 in hardware (torch emulates it on older GPUs, slower than float32)."""
    if device.index is not None and torch.cuda.is_available() and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # the query is about the current device
            return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.is_bf16_supported(including_emulation=False)


@dataclass
class _Observed:
    """What zero-code AMP sees of the training loop, shared by every model in the process."""

    steps: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)  # optimizer -> steps
    lr: float | torch.Tensor | None = None  # of the optimizer that stepped last (a tensor lr is read when used)
    loss: torch.Tensor | None = None  # the last scalar backward() was called on
    scaler: torch.amp.GradScaler | None = None
    scaled: bool = False  # a scaled loss was backpropagated since the last optimizer step
    update_due: bool = False  # the scaler stepped an optimizer: update it before the next iteration
    in_scaler_step: bool = False
    # Every optimizer under scaled() -> the steps its scaler skipped, and its steps when it was scaled.
    skipped: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    scaled_at: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    unscaled: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # unscaled or stepped since the update
    # scheduler -> its optimizer's (steps, skipped) when the scheduler last advanced
    advanced: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    found_inf: torch.Tensor | None = None  # what GradScaler handed a fused optimizer's step
    # optimizer -> how many of its fused steps skipped themselves (inf/NaN), a count on the device not read yet
    unsettled: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    @property
    def step(self) -> int:
        self.settle()
        return max(self.steps.values(), default=0)

    def settle(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Read the fused steps' skips not read yet (of `optimizer`, or all): `steps` and `skipped` are then exact.

        A fused optimizer skips its own step on the device, and reading whether it did waits for the device. So the
        count is read only when something decides by it: a scheduler's step, the policy's decision.
        """
        for opt in [optimizer] if optimizer is not None else list(self.unsettled.keys()):
            count = self.unsettled.pop(opt, None)
            skips = int(count.item()) if count is not None else 0
            if skips:
                self.steps[opt] -= skips
                self.skipped[opt] += skips

    def update_scaler(self) -> None:
        """`GradScaler.update()` once per iteration, after every scaled optimizer has stepped."""
        if self.update_due:
            self.scaler.update()
            self.unscaled.clear()  # update() readies every optimizer for unscale_ again
            self.update_due = self.scaled = False


_observed = _Observed()


@dataclass
class AmpState:
    """Zero-code AMP on one DDP model: `model.trainaccel.amp`."""

    dtype: torch.dtype
    device_type: str
    policy: PrecisionPolicy | None = None
    option: str = "fp16"  # the `amp` option that chose `dtype`
    forwards: int = 0
    autocast_forwards: int = 0
    decided_at: int | None = None  # the step the policy last decided at
    enabled: bool = True  # this forward runs under autocast (decided before it)

    def decide(self, training: bool) -> bool:
        if self.policy is None:
            return True
        step = _observed.step
        if training and step != self.decided_at:
            before = self.policy.decision if self.decided_at is not None else None
            self.decided_at = step
            lr = float(_observed.lr) if isinstance(_observed.lr, torch.Tensor) else _observed.lr
            self.policy.enabled(step=step, lr=lr, loss=_observed.loss, scaler=_observed.scaler)
            if self.policy.decision != before and speaks_for_job():
                if self.policy.decision:
                    log.info("amp: autocast from step %d", step)
                else:
                    log.info("amp: full precision from step %d (%s)", step, self.policy.reason)
        return self.policy.decision


def enable_amp(observer: StepObserver, config: Config) -> AmpState | None:
    """Run the model's forward under autocast as `config` says; its floating outputs come back float32 (only the loss,
    when the model computed its own)."""
    model = observer.model()
    device = next(model.parameters()).device
    device_type = device.type
    dtype = autocast_dtype(config.amp, device)
    if dtype is None or observer.amp is not None:
        return observer.amp
    policy = None if config.amp_policy == "always" else zero_code_policy(config.amp_policy)
    state = AmpState(dtype, device_type, policy, option=config.amp)
    if config.amp == "on":
        info_once(f"amp=on: autocast in {str(dtype).removeprefix('torch.')} on {device_type}")
    if device_type == "cpu" and not native_cpu_support(dtype):
        warn_once(
            f"amp={config.amp}: this CPU has no native {dtype} matrix instructions (AVX512-BF16 or AMX); "
            "autocast on it is likely slower than float32 (see docs/results.md#mixed-precision-and-compilation)"
        )
    if policy is not None:
        _observe_training_loop()
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        # Decided by the observer's pre-hook, outside any compiled graph: only the bool comes in here.
        enabled = state.enabled
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            output = forward(*args, **kwargs)
        return as_float32(output) if enabled else output

    model.forward = autocast_forward
    observer.on_detach(functools.partial(vars(model).pop, "forward", None))
    observer.subscribe("step_begin", functools.partial(_before_forward, state, True))
    observer.subscribe("eval", functools.partial(_before_forward, state, None))
    observer.amp = state
    return state


def _before_forward(state: AmpState, training: bool | None, observer: StepObserver, args: tuple, kwargs: dict) -> None:
    """Bookkeeping before a forward: the deferred scaler update, the decision, the fp16 check."""
    if training is None:  # an eval event (gradients off): in the mode the script set
        training = observer.training_mode()
    _observed.update_scaler()
    enabled = state.decide(training)
    if enabled and state.dtype == torch.float16 and _observed.scaler is None and training and torch.is_grad_enabled():
        if state.option == "on":
            raise RuntimeError(
                "amp=on autocasts in float16 here (this GPU has no native bfloat16), which needs loss scaling, or "
                "small gradients underflow to zero: add `optimizer = trainaccel.amp.scaled(optimizer)` after "
                "building the optimizer, or use amp=off (this GPU only emulates bfloat16)"
            )
        raise RuntimeError(
            "amp=fp16 needs loss scaling, or small gradients underflow to zero: add "
            "`optimizer = trainaccel.amp.scaled(optimizer)` after building the optimizer, or use amp=bf16 (a "
            "script with its own GradScaler keeps it with its own autocast, without amp=fp16)"
        )
    state.forwards += 1
    state.autocast_forwards += enabled
    state.enabled = enabled


def native_cpu_support(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices in hardware (else oneDNN emulates it, slowly)."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
    return cpu._is_amx_fp16_supported()


def as_float32(output: Any) -> Any:
    """A forward's output for code outside autocast: its half-precision tensors in float32.

    A loss computed outside the model would run where autocast would have run it in float32. When the model returns
    its own loss (a mapping with a `loss`, as Hugging Face models given labels do), that loss alone is converted:
    the other outputs (an LM's logits, batch x sequence x vocabulary) stay as computed, at half the memory.
    """
    if isinstance(output, MutableMapping) and output.get("loss") is not None:
        output["loss"] = _to_float32(output["loss"])
        return output
    return tree_map(_to_float32, output)


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
    config = context.current_config()
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    device_type = device.type
    if config is None or autocast_dtype(config.amp, device) != torch.float16:
        return optimizer
    if getattr(optimizer, "trainaccel_scaler", None) is not None:
        return optimizer
    if _observed.scaler is None:
        _observed.scaler = scaler or torch.amp.GradScaler(device_type)
    elif scaler is not None and scaler is not _observed.scaler:
        raise ValueError(
            "every optimizer shares one GradScaler (the loss is scaled once): pass the same scaler or none"
        )
    _observe_training_loop()
    _observed.skipped[optimizer] = 0
    _observed.scaled_at[optimizer] = _observed.steps.get(optimizer, 0)
    original_step = optimizer.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if _observed.in_scaler_step:  # GradScaler calling back; a fused optimizer gets found_inf to skip by
            _observed.found_inf = getattr(self, "found_inf", None)
            return original_step(*args, **kwargs)
        if not _observed.scaled:
            return original_step(*args, **kwargs)
        steps, _observed.found_inf = _observed.steps.get(self, 0), None
        _observed.in_scaler_step = True
        try:
            result = _observed.scaler.step(self, *args, **kwargs)
        finally:
            _observed.in_scaler_step = False
        _observed.update_due = True
        _observed.unscaled.add(self)
        if _observed.steps.get(self, 0) == steps:  # GradScaler found inf/NaN and did not call the step
            _observed.skipped[self] += 1
        elif _observed.found_inf is not None:  # a fused step, which skipped itself if found_inf: counted on the device
            skip = (_observed.found_inf != 0).sum()
            count = _observed.unsettled.get(self)
            _observed.unsettled[self] = skip if count is None else count.add_(skip)
        return result

    # A bound method, as torch's schedulers expect (they wrap `optimizer.step.__func__`); the
    # copied attributes keep a scheduler's mark that it already wrapped the step.
    functools.update_wrapper(step, original_step)
    del step.__wrapped__  # its signature is not the bound original's
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.trainaccel_scaler = _observed.scaler
    context.on_undo("amp.scaled optimizer", functools.partial(_unscaled, weakref.ref(optimizer), step))
    return optimizer


def _unscaled(ref: weakref.ref, step: Any) -> None:
    """Undo `scaled` on an optimizer still alive: its own step again, no scaler."""
    optimizer = ref()
    if optimizer is None:
        return
    vars(optimizer).pop("trainaccel_scaler", None)
    # A scheduler built afterwards wrapped our step in its own: that one stays, and ours, inside it,
    # steps plainly once nothing is scaled (as after shutdown()).
    if getattr(vars(optimizer).get("step"), "__func__", None) is step:
        del vars(optimizer)["step"]


def _observe_training_loop() -> None:
    """Count optimizer steps, note the learning rate and the loss (and scale it under `scaled`); once."""
    if not context.first_time("amp observation"):
        return

    def before_step(optimizer: torch.optim.Optimizer) -> None:
        if _observed.scaled and not _observed.in_scaler_step:
            raise RuntimeError(
                f"the gradients are loss-scaled (amp=fp16) but this {type(optimizer).__name__} would step on them "
                "unscaled: pass every optimizer to trainaccel.amp.scaled() before training"
            )

    def after_step(optimizer: torch.optim.Optimizer) -> None:
        _observed.steps[optimizer] = _observed.steps.get(optimizer, 0) + 1
        lr = optimizer.param_groups[0]["lr"]  # a tensor (capturable optimizers) is copied on its device, not read
        _observed.lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else float(lr)

    def before_backward(loss: torch.Tensor) -> torch.Tensor:
        _observed.loss = loss.detach()
        if _observed.scaler is None:
            return loss
        _observed.update_scaler()
        _observed.scaled = True
        return _observed.scaler.scale(loss)

    watch_optimizer_steps(before_step, after_step)
    watch_backward(before_backward)
    _patch_clipping()
    _patch_schedulers()
    context.on_undo("amp observations", _forget)


def _forget() -> None:
    """A fresh start for what AMP observed (at `shutdown()`)."""
    global _observed
    _observed = _Observed()


def _patch_clipping() -> None:
    """Unscale the gradients before the script clips them, wherever it reaches the clipping functions."""
    from torch.nn.utils import clip_grad

    # clip_grad_norm_ calls the module's _get_total_norm and _clip_grads_with_norm_ (public as
    # get_total_norm and clip_grads_with_norm_): patching those too catches a clip_grad_norm_
    # that the script imported by name before the patch.
    targets = {  # the function -> whether it takes gradients (else parameters)
        getattr(clip_grad, name): takes_grads
        for name, takes_grads in [
            ("clip_grad_norm_", False),
            ("clip_grad_value_", False),
            ("_clip_grads_with_norm_", False),
            ("_get_total_norm", True),
        ]
        if hasattr(clip_grad, name)
    }
    wrappers = {id(clip): _unscaling(clip, takes_grads) for clip, takes_grads in targets.items()}
    for module in (torch.nn.utils, clip_grad):
        for name, value in list(vars(module).items()):
            if id(value) in wrappers:
                context.patch(module, name, wrappers[id(value)])


def _unscaling(clip: Any, takes_grads: bool) -> Any:
    """`clip`, first unscaling the gradients of its tensors (parameters, or gradients if `takes_grads`)."""
    first = next(iter(inspect.signature(clip).parameters))

    @functools.wraps(clip)
    def unscaling_clip(*args: Any, **kwargs: Any) -> Any:
        if _observed.scaled and _observed.scaler is not None:
            tensors = args[0] if args else kwargs[first]
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)  # iterated twice
            if args:
                args = (tensors, *args[1:])
            else:
                kwargs[first] = tensors
            _unscale_holders(tensors, takes_grads)
        return clip(*args, **kwargs)

    return unscaling_clip


def _unscale_holders(tensors: list[torch.Tensor], are_grads: bool) -> None:
    """`GradScaler.unscale_` each scaled optimizer holding `tensors` and not unscaled this iteration."""
    holders = {}
    for optimizer in list(_observed.skipped.keys()):
        for group in optimizer.param_groups:
            for p in group["params"]:
                key = p.grad if are_grads else p
                if key is not None:
                    holders[id(key)] = optimizer
    pending, strangers = {}, 0
    for tensor in tensors:
        if not are_grads and tensor.grad is None:
            continue
        optimizer = holders.get(id(tensor))
        if optimizer is not None:
            pending[optimizer] = None
        elif not are_grads:  # get_total_norm also measures tensors that are no gradients
            strangers += 1
    if strangers:
        raise RuntimeError(
            f"gradient clipping under amp=fp16: the gradients are loss-scaled and {strangers} of these parameters "
            "belong to no optimizer passed to trainaccel.amp.scaled(), so they cannot be unscaled first: "
            "pass their optimizer to trainaccel.amp.scaled() before training"
        )
    for optimizer in pending:
        if optimizer in _observed.unscaled:
            continue
        try:
            _observed.scaler.unscale_(optimizer)
        except RuntimeError:
            # GradScaler refuses a second unscale_ per update: the script called it itself, as the
            # plain recipe does. Any other failure recurs in the scaler's step.
            pass
        _observed.unscaled.add(optimizer)


def _patch_schedulers() -> None:
    """A scheduler advances only with real steps of its optimizer, not with those the scaler skipped."""
    from torch.optim import lr_scheduler

    # Patched on every class that overrides step (ReduceLROnPlateau, SequentialLR, ...), since
    # those do not call LRScheduler.step.
    for cls in list(vars(lr_scheduler).values()):
        if isinstance(cls, type) and issubclass(cls, lr_scheduler.LRScheduler) and "step" in vars(cls):
            context.patch(cls, "step", _in_step_with_optimizer(vars(cls)["step"]))


def _in_step_with_optimizer(original_step: Any) -> Any:
    """A scheduler's `original_step`, skipped while its optimizer has only skipped steps since the last one."""

    @functools.wraps(original_step)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or optimizer not in _observed.skipped:  # not under scaled()
            return original_step(self, *args, **kwargs)
        _observed.settle(optimizer)
        now = (_observed.steps.get(optimizer, 0), _observed.skipped[optimizer])
        # Unseen schedulers compare with the optimizer when it was scaled: the initial step at
        # construction runs, and so does a per-epoch step after any real step in the epoch.
        steps, skipped = _observed.advanced.get(self, (_observed.scaled_at.get(optimizer, 0), 0))
        if now[0] == steps and now[1] > skipped:
            info_once(
                "amp=fp16: a learning-rate scheduler step was skipped along with its optimizer's "
                "(inf/NaN gradients): schedulers advance with real optimizer steps only"
            )
            return None
        _observed.advanced[self] = now
        return original_step(self, *args, **kwargs)

    return step
