"""Monitors on DDP models, timed from forward to forward: metrics (`--metrics-every N`), stragglers, timeline steps.

For metrics, a step's data wait is the time from the optimizer's step to the next forward (loading, zero_grad, the
loop's own work); its batch size is the first dimension of the forward's first tensor argument.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from trainaccel.config import Config
from trainaccel.context import info_once, speaks_for_job
from trainaccel.monitor import timeline
from trainaccel.monitor.metrics import StepMeter
from trainaccel.monitor.straggler import StragglerDetector

if TYPE_CHECKING:
    from trainaccel.comm.hooks import CommWait
    from trainaccel.observer import StepObserver


def _batch_size(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = _batch_size(item)
        if found is not None:
            return found
    return None


def attach_meter(observer: StepObserver, config: Config) -> StepMeter:
    """Give the model a StepMeter (`model.trainaccel.meter`) fed by its training steps and optimizer steps."""
    model = observer.model()
    device = next((p.device for p in model.parameters()), None)
    logs_here = None
    if config.on_lost_replica == "continue":
        # Pooling over DDP's group would wait for a lost rank forever: each worker's own figures, logged by the lowest
        # rank still a member.
        info_once(
            "metrics_every under on_lost_replica=continue: each line holds the figures of the worker that logs it "
            "(the lowest live rank), not every worker's pooled, so that no line waits for a lost one"
        )
        logs_here = speaks_for_job
    meter = StepMeter(config.metrics_every, device=device, process_group=model.process_group, logs_here=logs_here)
    pending: dict[str, Any] = {"batch": None, "stepped_at": None}

    def step_begin(observer: StepObserver, args: tuple, kwargs: dict) -> None:
        now = time.perf_counter()
        if pending["batch"] is None:
            meter.restart()
        else:
            data = now - pending["stepped_at"] if pending["stepped_at"] is not None else 0.0
            meter.step(pending["batch"], data_time=data)
        pending["batch"] = _batch_size((args, kwargs)) or 0
        pending["stepped_at"] = None

    def after_optimizer_step(observer: StepObserver, optimizer: Any) -> None:
        pending["stepped_at"] = time.perf_counter()

    observer.subscribe("step_begin", step_begin)
    observer.subscribe("after_optimizer_step", after_optimizer_step)
    observer.meter = meter
    return meter


def watch_steps(observer: StepObserver, config: Config, comm_wait: CommWait | None) -> None:
    """Straggler checks and timeline step spans, closed at each training step of the model.

    A step runs from one training forward to the next. Its own work excludes the wait for peers
    measured by the communication hook (`comm_wait`) and the observer's forward pre-hook (other
    monitors' collectives run there).
    """
    model = observer.model()
    detector = None
    if config.straggler_every:
        device = next((p.device for p in model.parameters()), None)
        detector = StragglerDetector(
            config.straggler_every, config.straggler_threshold, process_group=model.process_group, device=device
        )
        observer.stragglers = detector
    started: dict[str, float | None] = {"at": None}

    def step_begin(observer: StepObserver, args: tuple, kwargs: dict) -> None:
        now = time.perf_counter()
        wait = comm_wait.take() if comm_wait is not None else 0.0
        if started["at"] is not None:
            trace = timeline.current()
            if trace is not None:
                # the span is the step that just ended: counted from 0, it is the one before this one's
                trace.span(f"step {observer.step - 2}", started["at"], now, timeline.STEPS_TRACK, "step")
                trace.flush()
            if detector is not None:
                detector.waited(wait + now - observer.entered)
                detector.step()
        elif detector is not None:
            detector.restart()
        started["at"] = now

    observer.subscribe("step_begin", step_begin)
