"""Monitors on DDP models, timed from forward to forward: metrics (`--metrics-every N`), stragglers, timeline steps.

For metrics, a step's data wait is the time from the optimizer's step to the next forward (loading, zero_grad, the
loop's own work); its batch size is the first dimension of the forward's first tensor argument.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from trainaccel.config import Config
from trainaccel.monitor import timeline
from trainaccel.monitor.metrics import StepMeter
from trainaccel.monitor.straggler import StragglerDetector

if TYPE_CHECKING:
    from trainaccel.comm.hooks import CommWait


def _batch_size(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = _batch_size(item)
        if found is not None:
            return found
    return None


def attach_meter(ddp_model: DistributedDataParallel, config: Config) -> StepMeter:
    """Give `ddp_model` a StepMeter (`ddp_model.trainaccel_meter`) fed by its forwards and optimizer steps."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    device = next((p.device for p in ddp_model.parameters()), None)
    meter = StepMeter(config.metrics_every, device=device, process_group=ddp_model.process_group)
    pending: dict[str, Any] = {"batch": None, "stepped_at": None}

    def before_forward(module: DistributedDataParallel, args: tuple, kwargs: dict) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation forwards are not training steps
        now = time.perf_counter()
        if pending["batch"] is None:
            meter.restart()
        else:
            data = now - pending["stepped_at"] if pending["stepped_at"] is not None else 0.0
            meter.step(pending["batch"], data_time=data)
        pending["batch"] = _batch_size((args, kwargs)) or 0
        pending["stepped_at"] = None

    def after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        pending["stepped_at"] = time.perf_counter()

    if config.compile == "on" or "torch._dynamo" in sys.modules:
        before_forward = torch.compiler.disable(before_forward)  # its all-reduce stays out of any graph
    ddp_model.register_forward_pre_hook(before_forward, with_kwargs=True)
    ddp_model._trainaccel_meter_hook = register_optimizer_step_post_hook(after_optimizer_step)
    ddp_model.trainaccel_meter = meter
    return meter


def watch_steps(ddp_model: DistributedDataParallel, config: Config, comm_wait: CommWait | None) -> None:
    """Straggler checks and timeline step spans, closed at each training forward of `ddp_model`.

    A step runs from one training forward to the next. Its own work excludes the wait for peers
    measured by the communication hook (`comm_wait`) and the forward pre-hooks (other monitors'
    collectives run there).
    """
    detector = None
    if config.straggler_every:
        device = next((p.device for p in ddp_model.parameters()), None)
        detector = StragglerDetector(
            config.straggler_every, config.straggler_threshold, process_group=ddp_model.process_group, device=device
        )
        ddp_model.trainaccel_stragglers = detector
    clock: dict[str, Any] = {"entered": 0.0, "step_start": None, "steps": 0}

    def enter(module: DistributedDataParallel, args: tuple) -> None:
        clock["entered"] = time.perf_counter()

    def before_forward(module: DistributedDataParallel, args: tuple) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        now = time.perf_counter()
        wait = comm_wait.take() if comm_wait is not None else 0.0
        if clock["step_start"] is not None:
            trace = timeline.current()
            if trace is not None:
                trace.span(f"step {clock['steps']}", clock["step_start"], now, timeline.STEPS_TRACK, "step")
                trace.flush()
            if detector is not None:
                detector.waited(wait + now - clock["entered"])
                detector.step()
        elif detector is not None:
            detector.restart()
        clock["step_start"] = now
        clock["steps"] += 1

    if config.compile == "on" or "torch._dynamo" in sys.modules:
        before_forward = torch.compiler.disable(before_forward)  # its collective stays out of any graph
    ddp_model.register_forward_pre_hook(enter, prepend=True)
    ddp_model.register_forward_pre_hook(before_forward)
