"""Momentum correction for topk and randomk, zero-code: an SGD optimizer's momentum moves into error feedback.

What a sparse codec does not send waits in a residual and reaches the optimizer steps later. An
optimizer with momentum then amplifies that late part again (heavy ball by up to 1/(1-m)), and the
model trains worse than plain DDP. Under `compression_momentum=auto` (the default), once the
warm-up's exact steps are done, the script's `torch.optim.SGD` hands its momentum, dampening,
Nesterov flag and weight decay to the engine: error feedback applies them to each worker's
gradient before the codec (Deep Gradient Compression's momentum correction), and the optimizer
applies what arrives with momentum and weight decay 0. The optimizer's momentum buffers become
the engine's velocities, so the trajectory goes on without a jump. What has been applied then
equals momentum SGD's update minus what waits in the residuals.

The optimizer's `state_dict()` keeps reporting the script's settings (without momentum buffers),
so a checkpoint also resumes under plain torch; `shutdown()` gives the settings back. An optimizer
this cannot take over (another type, maximize, groups with different momentum, parameters of other
models) keeps its momentum, and a warning says that the loss will likely be worse.

Each lossy codec also says once, at the first step of an optimizer, where our measurements say it
costs quality with that optimizer (`quality_warning`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from trainaccel import context
from trainaccel.context import info_once, warn_once
from trainaccel.observer import StepObserver

MARK = "trainaccel_moved"  # in a param group taken over: the settings the script gave it
MOVED = ("momentum", "dampening", "nesterov", "weight_decay")
SPARSE_CODECS = ("topk", "randomk")
# Optimizers taken over in this process -> their state_dict hook's handle (until shutdown()).
_taken: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
# Optimizers that scale each coordinate by its own history: a sparse codec's late, bunched-up
# updates distort those statistics, and no correction of ours undoes that.
ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Adafactor", "SparseAdam")


class MovedMomentum:
    """The momentum and weight decay the engine applies for an SGD optimizer (one per hook state)."""

    __slots__ = {
        "momentum": "the optimizer's momentum, applied by error feedback (0 until taken over)",
        "dampening": "the optimizer's dampening",
        "nesterov": "the optimizer's Nesterov flag",
        "weight_decay": "id(parameter) -> its weight decay, added to its gradient before the codec",
        "pending": "id(parameter) -> its optimizer momentum buffer / world size, until its bucket's velocity starts",
        "optimizers": "the optimizers taken over (weakly held)",
        "declined": "optimizers found unfit, already warned about (weakly held)",
    }

    def __init__(self) -> None:
        self.momentum, self.dampening, self.nesterov = 0.0, 0.0, False
        self.weight_decay: dict[int, float] = {}
        self.pending: dict[int, torch.Tensor] = {}
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.declined: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def settings(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "dampening": self.dampening, "nesterov": self.nesterov}


def attach(observer: StepObserver, state: Any, compression: str, momentum: float | str) -> None:
    """Watch the optimizers stepping `observer`'s model: say once where the codec costs quality, take over SGD's
    momentum."""
    if compression not in (*SPARSE_CODECS, "powersgd"):
        return
    if momentum == "auto" and compression in SPARSE_CODECS:
        state.moved = MovedMomentum()
    warned: set[str] = set()

    def on_step(observer: StepObserver, optimizer: torch.optim.Optimizer, before: bool) -> None:
        if _only_sparse(optimizer):
            return  # its gradients are averaged exactly, not through the codec: nothing to warn of or take over
        kind = type(optimizer).__name__
        if kind not in warned:
            warned.add(kind)
            why = quality_warning(compression, optimizer)
            if why is not None:
                warn_once(f"compression={compression} with {kind}: {why}")
        if state.moved is not None:
            take_over(observer, state, optimizer, before)

    def at_step_begin(observer: StepObserver, args: tuple, kwargs: dict) -> None:
        # A scheduler steps after the optimizer (OneCycleLR sets momentum): catch it before this step's backward.
        for optimizer in list(state.moved.optimizers):
            if _is_moved(optimizer):
                _follow_changes(state, optimizer)

    if state.moved is not None:
        observer.subscribe("step_begin", at_step_begin)
    observer.subscribe("before_optimizer_step", lambda o, opt: on_step(o, opt, True))
    observer.subscribe("after_optimizer_step", lambda o, opt: on_step(o, opt, False))


def quality_warning(compression: str, optimizer: torch.optim.Optimizer) -> str | None:
    """Why `compression` will likely end with a worse validation loss than plain DDP under `optimizer`, or None.

    From `trainaccel bench quality` (docs/results.md#which-per-step-codec-keeps-quality): a momentum-free SGD is the
    case error feedback is made for; with momentum or an adaptive optimizer, the sparse codecs lost more than 2% in
    every trial.
    """
    kind = type(optimizer).__name__
    keep = "compression=fp16 or bf16 keep quality (docs/results.md#which-per-step-codec-keeps-quality)"
    if compression == "powersgd":
        if kind in ADAPTIVE or (isinstance(optimizer, torch.optim.SGD) and _momentum_of(optimizer)["momentum"]):
            return (
                "PowerSGD's low-rank approximation with error feedback ended 7% above plain DDP's validation loss "
                f"with AdamW (and above it with SGD + Nesterov momentum) in our trials; {keep}"
            )
        return None
    if kind in ADAPTIVE:
        return (
            f"{kind} scales each coordinate by its own gradient history, which a sparse codec's delayed updates "
            f"distort; expect a worse loss than plain DDP at equal steps; {keep}"
        )
    momentum = _momentum_of(optimizer)["momentum"] if isinstance(optimizer, torch.optim.SGD) else 0.0
    if not momentum:  # a momentum-free SGD (what error feedback is made for), or an optimizer unknown here
        return None
    if compression == "randomk":
        return (
            "randomk holds each element back for up to 1/compression_ratio steps, and momentum turns those delays "
            f"into overshoot: it did not train (1% and 10%) with SGD + Nesterov momentum in our trials; {keep}"
        )
    return (
        "even with momentum correction, topk at 1% ended 4% above plain DDP's validation loss with SGD + Nesterov "
        f"momentum in our trials (2% at compression_ratio=0.1, which sends more than fp16 does); {keep}"
    )


def feedbacks(state: Any) -> list[Any]:
    """The error feedback objects that apply the moved momentum (across nodes when hierarchical)."""
    if state.feedback is not None:
        return [state.feedback]
    hierarchy = state.hierarchy
    return [hierarchy.feedback] if hierarchy is not None and hierarchy.feedback is not None else []


def take_over(observer: StepObserver, state: Any, optimizer: torch.optim.Optimizer, before: bool) -> None:
    """Move `optimizer`'s momentum into the engine when its next step applies a compressed gradient.

    After a step (`before` False): when the next reduction compresses, with the optimizer's buffers
    carried over. Before a step: when this step's gradient was already compressed (a resumed job,
    an optimizer built or reloaded mid-run): its buffers are dropped, the engine's velocities hold them.
    """
    moved = state.moved
    if optimizer in moved.declined:
        return
    if optimizer in moved.optimizers and _is_moved(optimizer):
        if before:  # set after this step's forward: the engine follows from the next step (one step late)
            _follow_changes(state, optimizer)
        return
    due = state.last_step_compressed if before else state.reductions >= max(1, state.warmup_steps)
    if not due:
        return
    why = _why_not(observer, optimizer)
    if why is None and moved.momentum and _momentum_of(optimizer) != moved.settings():
        why = f"its momentum differs from the one already taken over ({moved.settings()})"
    if why is not None:
        moved.declined.add(optimizer)
        if _momentum_of(optimizer)["momentum"]:
            warn_once(
                f"compression={state.codec.name}: momentum correction is off for {type(optimizer).__name__} ({why}): "
                "its momentum amplifies the gradients that wait in the residuals; expect a worse loss than plain "
                "DDP at equal steps (compression_momentum=auto takes over plain torch.optim.SGD)"
            )
        return
    settings = _momentum_of(optimizer)
    if not settings["momentum"]:
        moved.declined.add(optimizer)  # momentum-free SGD: error feedback alone is right
        return
    world = dist.get_world_size(state.group)
    for group in optimizer.param_groups:
        if not group["momentum"]:
            continue
        group[MARK] = {k: group[k] for k in MOVED}
        for p in group["params"]:
            if group["weight_decay"]:
                moved.weight_decay[id(p)] = group["weight_decay"]
            buffer = optimizer.state.get(p, {}).pop("momentum_buffer", None)
            if buffer is not None and not before:
                moved.pending[id(p)] = buffer.div_(world)
        group.update(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)
    _apply(state, settings)
    if optimizer not in moved.optimizers:
        moved.optimizers.add(optimizer)
        if optimizer not in _taken:
            # Undone by shutdown() even where the model is gone by then: the optimizer may live on.
            _taken[optimizer] = optimizer.register_state_dict_post_hook(_scripts_settings)
            if context.first_time("moved momentum"):
                context.on_undo("moved momentum", _give_back_all)
    info_once(
        f"compression={state.codec.name}: error feedback applies {type(optimizer).__name__}'s momentum "
        f"{moved.momentum:g}{' (Nesterov)' if moved.nesterov else ''} and weight decay from step "
        f"{state.reductions + (0 if before else 1)} (momentum correction; the optimizer runs without them)"
    )


def _follow_changes(state: Any, optimizer: torch.optim.Optimizer) -> None:
    """A scheduler (OneCycleLR cycles momentum) or the script set momentum or weight decay in a group taken
    over: the engine applies the new values from the next step on, and the optimizer stays without them."""
    moved = state.moved
    for group in optimizer.param_groups:
        if MARK not in group or not any(group[k] for k in MOVED):
            continue
        group[MARK].update({k: group[k] for k in MOVED if group[k]})
        _apply(state, group[MARK])
        for p in group["params"]:
            moved.weight_decay[id(p)] = group[MARK]["weight_decay"]
        group.update(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)


def _is_moved(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group with momentum is taken over (a `load_state_dict` brings the script's settings back)."""
    return all(MARK in g or not g.get("momentum") for g in optimizer.param_groups)


def _momentum_of(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The momentum settings of the optimizer's groups with momentum, as the script gave them."""
    for group in optimizer.param_groups:
        settings = group.get(MARK, group)
        if settings.get("momentum"):
            return {k: settings[k] for k in ("momentum", "dampening", "nesterov")}
    return {"momentum": 0.0, "dampening": 0.0, "nesterov": False}


def _why_not(observer: StepObserver, optimizer: torch.optim.Optimizer) -> str | None:
    """Why this optimizer's momentum cannot be taken over, or None."""
    if type(optimizer) is not torch.optim.SGD:
        return f"{type(optimizer).__name__} is not torch.optim.SGD"
    kinds = set()
    for group in optimizer.param_groups:
        settings = group.get(MARK, group)
        if group.get("maximize"):
            return "maximize=True"
        if any(not observer.holds(p) for p in group["params"]):
            return "it also steps parameters of another model"
        dense = any(p.grad is not None and not p.grad.is_sparse for p in group["params"])
        if settings["momentum"] and any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
            # Sparse gradients are averaged exactly, without the engine's velocities: they keep the optimizer's.
            return "a parameter group with sparse gradients has momentum, which error feedback cannot apply to them"
        if settings["momentum"] or dense:
            kinds.add((settings["momentum"], settings["dampening"], settings["nesterov"]))
    if len(kinds) > 1:
        return "its parameter groups have different momentum settings"
    return None


def _only_sparse(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient `optimizer` holds now is sparse (averaged exactly, never through the codec)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return bool(grads) and all(grad.is_sparse for grad in grads)


def _scripts_settings(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """`optimizer.state_dict()` as the script set it up: its groups' own settings, not the engine's zeros."""
    groups = []
    for group in saved["param_groups"]:
        group = dict(group)
        group.update(group.pop(MARK, {}))
        groups.append(group)
    return {**saved, "param_groups": groups}


def _give_back_all() -> None:
    """The script's settings back in every optimizer taken over (`shutdown()`); their momentum buffers start afresh."""
    for optimizer, handle in list(_taken.items()):
        handle.remove()
        for group in optimizer.param_groups:
            group.update(group.pop(MARK, {}))
    _taken.clear()


def bucket_velocity(moved: MovedMomentum, bucket: Any, buffer: torch.Tensor) -> torch.Tensor | None:
    """Add the moved weight decay to the bucket's gradients; the optimizer's momentum for its velocity, if due.

    Call on the communication thread before the bucket is compressed (the layout is the bucket buffer's).
    """
    velocity, offset = None, 0
    for p, grad in zip(bucket.parameters(), bucket.gradients()):
        n = grad.numel()
        decay = moved.weight_decay.get(id(p))
        if decay:
            grad.add_(p.detach(), alpha=decay)
        carried = moved.pending.pop(id(p), None)
        if carried is not None:
            if velocity is None:
                velocity = torch.zeros_like(buffer)
            velocity[offset : offset + n].copy_(carried.reshape(-1))
        offset += n
    return velocity


def restore_moved(state: Any, saved: dict[str, Any]) -> None:
    """Apply a checkpoint's moved momentum (see `take_over`) before the resumed job's first step."""
    moved, id_of = state.moved, {name: i for i, name in state.param_names.items()}
    _apply(state, saved)
    moved.weight_decay = {id_of[name]: decay for name, decay in saved["weight_decay"].items() if name in id_of}
    moved.pending.clear()


def _apply(state: Any, settings: dict[str, Any]) -> None:
    """The engine's momentum from now on: `settings`' momentum, dampening and Nesterov flag."""
    moved = state.moved
    moved.momentum, moved.dampening, moved.nesterov = (settings[k] for k in ("momentum", "dampening", "nesterov"))
    for feedback in feedbacks(state):
        feedback.momentum, feedback.dampening, feedback.nesterov = moved.momentum, moved.dampening, moved.nesterov
        feedback.masking = False  # masking the momentum factor cost quality in our trials (docs/communication.md)
