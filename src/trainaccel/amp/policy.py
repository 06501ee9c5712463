"""`PrecisionPolicy`: decide per epoch or per step whether to autocast, from time, learning rate and loss."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

MODES = ("time", "lr", "loss", "auto")
UNITS = ("epoch", "step")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class _Memory:
    """What a policy has seen; all of it goes into `state_dict()`."""

    last_lr: float | None = None
    lr_hold_until: int | None = None  # full precision while t < this (after a learning-rate change)
    loss_hold_until: int | None = None  # full precision while t < this (after loss trouble)
    losses: list[float] = field(default_factory=list)  # recent finite losses, for the spike check
    last_scale: float | None = None
    shrinks: list[bool] = field(default_factory=list)  # recent calls: did the GradScaler's scale shrink?
    decision: bool = False
    reason: str = "not decided yet"


class PrecisionPolicy:
    """Decides, per epoch or per step, whether to run under autocast.

    - `time`: full precision before `start`, autocast from `start` through `end` inclusive
      (`end=None`: to the end of training).
    - `lr`: as `time`, and for `hold` units from each learning-rate change, full precision; a
      change is a relative move above `lr_tolerance` (default: any for `lr`, 10% for `auto`, so
      that a schedule stepped every step counts only its big moves).
    - `loss`: autocast, except for `hold` units from when the loss is non-finite, exceeds its
      minimum over the last `window` values by more than `spike` (0.5: 50% above), or the
      GradScaler's scale shrank at least `overflows` times in the last `window` calls. Checked
      in windows `[k*interval, k*interval + interval_hold)`, k >= 1, or always when `interval`
      is None.
    - `auto` (the default): all three, per step.

    Examples:
        >>> policy = PrecisionPolicy("time", start=2, end=3)
        >>> [policy.enabled(epoch=e) for e in range(5)]
        [False, False, True, True, False]
        >>> policy = PrecisionPolicy("lr", start=0, hold=2)
        >>> [policy.enabled(epoch=e, lr=lr) for e, lr in enumerate([0.1, 0.1, 0.01, 0.01, 0.01])]
        [True, True, False, False, True]
        >>> policy = PrecisionPolicy("loss", hold=2, per="step")
        >>> [policy.enabled(step=s, loss=l) for s, l in enumerate([1.0, 0.9, 5.0, 0.8, 0.8, 0.8])]
        [True, True, False, False, True, True]
    """

    def __init__(
        self,
        mode: str = "auto",
        *,
        start: int = 0,
        end: int | None = None,
        hold: int = 1,
        interval: int | None = None,
        interval_hold: int | None = None,
        spike: float = 0.5,
        window: int = 100,
        overflows: int = 3,
        per: str | None = None,
        dtype: str | None = None,
        lr_tolerance: float | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"invalid mode={mode!r}; accepted: {', '.join(MODES)}")
        per = per or ("step" if mode == "auto" else "epoch")
        if per not in UNITS:
            raise ValueError(f"invalid per={per!r}; accepted: {', '.join(UNITS)}")
        for name, value, least in (
            ("start", start, 0),
            ("hold", hold, 0),
            ("window", window, 1),
            ("overflows", overflows, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"invalid {name}={value!r}; accepted: an integer >= {least}")
        if end is not None and (isinstance(end, bool) or not isinstance(end, int) or end < start):
            raise ValueError(
                f"invalid end={end!r}; accepted: None (to the end of training) or an integer >= start ({start})"
            )
        if interval is not None:
            if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
                raise ValueError(f"invalid interval={interval!r}; accepted: None (check always) or an integer >= 1")
            interval_hold = interval if interval_hold is None else interval_hold
            if (
                isinstance(interval_hold, bool)
                or not isinstance(interval_hold, int)
                or not 1 <= interval_hold <= interval
            ):
                raise ValueError(
                    f"invalid interval_hold={interval_hold!r}; accepted: an integer from 1 to interval ({interval})"
                )
        if not isinstance(spike, (int, float)) or isinstance(spike, bool) or not spike > 0:
            raise ValueError(
                f"invalid spike={spike!r}; accepted: a number > 0 (0.5: a loss 50% above its recent minimum)"
            )
        lr_tolerance = (0.1 if mode == "auto" else 0.0) if lr_tolerance is None else lr_tolerance
        if isinstance(lr_tolerance, bool) or not isinstance(lr_tolerance, (int, float)) or not lr_tolerance >= 0:
            raise ValueError(
                f"invalid lr_tolerance={lr_tolerance!r}; accepted: a number >= 0 (0.1: a move of more than 10%)"
            )
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(
                f"invalid dtype={dtype!r}; accepted: None (bfloat16 on CPU, float16 on CUDA), {', '.join(DTYPES)}"
            )
        self.mode, self.per, self.dtype = mode, per, dtype
        self.start, self.end, self.hold = start, end, hold
        self.interval, self.interval_hold = interval, interval_hold
        self.spike, self.window, self.overflows = float(spike), window, overflows
        self.lr_tolerance = float(lr_tolerance)
        self._memory = _Memory()

    @property
    def decision(self) -> bool:
        """The latest decision (False before the first call to `enabled`)."""
        return self._memory.decision

    @property
    def reason(self) -> str:
        """Why the latest decision was taken, in a few words (for logs)."""
        return self._memory.reason

    def enabled(
        self,
        epoch: int | None = None,
        step: int | None = None,
        lr: float | None = None,
        loss: float | torch.Tensor | None = None,
        scaler: Any = None,
    ) -> bool:
        """Whether to autocast now; `epoch` or `step` (per the policy's unit) is required.

        `lr` is the current learning rate (mode `lr`); `loss` the latest loss and `scaler` the
        GradScaler (mode `loss`); `auto` uses whichever is given.
        """
        t = epoch if self.per == "epoch" else step
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"this policy decides per {self.per}: pass {self.per}= as an integer >= 0 (got {t!r})")
        if self.mode == "lr" and lr is None:
            raise ValueError("mode 'lr' needs lr= (the current learning rate) at every call")
        if self.mode == "loss" and loss is None and scaler is None:
            raise ValueError(
                "mode 'loss' needs loss= (the latest loss value) or scaler= (the GradScaler) at every call"
            )
        memory = self._memory
        decision, reason = True, "autocast"
        if self.mode in ("time", "lr", "auto"):
            if t < self.start:
                decision, reason = False, f"before start ({self.start})"
            elif self.end is not None and t > self.end:
                decision, reason = False, f"after end ({self.end})"
        if self.mode in ("lr", "auto") and lr is not None:
            if memory.last_lr is not None and abs(float(lr) - memory.last_lr) > self.lr_tolerance * abs(memory.last_lr):
                memory.lr_hold_until = t + self.hold
            memory.last_lr = float(lr)
            if decision and memory.lr_hold_until is not None and t < memory.lr_hold_until:
                decision, reason = (
                    False,
                    f"learning rate changed: full precision until {self.per} {memory.lr_hold_until}",
                )
        if self.mode in ("loss", "auto"):
            trouble = self._observe(t, loss, scaler)
            if trouble:
                memory.loss_hold_until = t + self.hold
            if decision and memory.loss_hold_until is not None and t < memory.loss_hold_until:
                decision, reason = (
                    False,
                    f"{trouble or 'loss trouble'}: full precision until {self.per} {memory.loss_hold_until}",
                )
        memory.decision, memory.reason = decision, reason
        return decision

    def _checking(self, t: int) -> bool:
        return self.interval is None or (t >= self.interval and t % self.interval < self.interval_hold)

    def _observe(self, t: int, loss: float | torch.Tensor | None, scaler: Any) -> str:
        """Record the loss and the scaler's scale; what is wrong with them when checked now, else ''."""
        memory, trouble = self._memory, ""
        if loss is not None:
            value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            if not math.isfinite(value):
                trouble = f"loss is {value}"
            else:
                if memory.losses and value > min(memory.losses) * (1 + self.spike) and min(memory.losses) > 0:
                    trouble = f"loss {value:.4g} spiked over its recent minimum {min(memory.losses):.4g}"
                memory.losses = (memory.losses + [value])[-self.window :]
        if scaler is not None and getattr(scaler, "is_enabled", lambda: True)():
            scale = float(scaler.get_scale())
            shrank = memory.last_scale is not None and scale < memory.last_scale
            memory.last_scale = scale
            memory.shrinks = (memory.shrinks + [shrank])[-self.window :]
            if sum(memory.shrinks) >= self.overflows and not trouble:
                trouble = f"GradScaler overflowed {sum(memory.shrinks)} times in {len(memory.shrinks)} calls"
        if not self._checking(t):
            return ""
        if trouble.startswith("GradScaler"):
            memory.shrinks = []  # count afresh after the hold
        return trouble

    def device_dtype(self, device_type: str) -> torch.dtype:
        """The autocast dtype on this device: the policy's, else bfloat16 on CPU and float16 on CUDA."""
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return torch.bfloat16 if device_type == "cpu" else torch.float16

    @contextlib.contextmanager
    def autocast(self, device_type: str | None = None) -> Iterator[None]:
        """`torch.autocast` with the latest decision (device: CUDA when available, else CPU)."""
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        with torch.autocast(device_type, dtype=self.device_dtype(device_type), enabled=self.decision):
            yield

    def state_dict(self) -> dict[str, Any]:
        """The settings and everything seen so far, as plain values (JSON-safe)."""
        settings = {
            "mode": self.mode,
            "per": self.per,
            "start": self.start,
            "end": self.end,
            "hold": self.hold,
            "interval": self.interval,
            "interval_hold": self.interval_hold,
            "spike": self.spike,
            "window": self.window,
            "overflows": self.overflows,
            "dtype": self.dtype,
            "lr_tolerance": self.lr_tolerance,
        }
        return {"settings": settings, "memory": asdict(self._memory)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`; the settings must match this policy's."""
        mine = self.state_dict()["settings"]
        if state["settings"] != mine:
            differ = sorted(k for k in mine if state["settings"].get(k) != mine[k])
            raise ValueError(
                f"this state is for a policy with other settings ({', '.join(differ)}): "
                f"{ {k: state['settings'].get(k) for k in differ} } vs { {k: mine[k] for k in differ} }"
            )
        self._memory = _Memory(**state["memory"])


_SETTINGS = {
    "start": int,
    "end": int,
    "hold": int,
    "interval": int,
    "interval_hold": int,
    "spike": float,
    "window": int,
    "overflows": int,
    "lr_tolerance": float,
}


def parse_policy(spec: str, **fixed: Any) -> PrecisionPolicy:
    """`mode[:setting=value,...]` -> PrecisionPolicy, e.g. `auto:start=1000,hold=50`; `fixed` settings are added."""
    mode, _, rest = spec.strip().partition(":")
    settings: dict[str, Any] = {}
    for item in filter(None, (i.strip() for i in rest.split(","))):
        name, eq, value = (part.strip() for part in item.partition("="))
        name = name.replace("-", "_")
        if not eq or name not in _SETTINGS:
            raise ValueError(f"invalid setting {item!r}; accepted: setting=value with settings {', '.join(_SETTINGS)}")
        try:
            settings[name] = None if value.lower() == "none" else _SETTINGS[name](value)
        except ValueError:
            raise ValueError(
                f"invalid {name}={value!r}; accepted: {'an integer' if _SETTINGS[name] is int else 'a number'}"
            ) from None
    return PrecisionPolicy(mode.strip().lower(), **settings, **fixed)


def zero_code_policy(spec: str) -> PrecisionPolicy:
    """The per-step policy of `amp_policy=spec`: mode auto or time, decided from what trainaccel observes."""
    mode = spec.strip().partition(":")[0].strip().lower()
    if mode not in ("auto", "time"):
        raise ValueError(
            f"mode {mode!r} needs its value at every call, before the first step too: use it through the API"
        )
    return parse_policy(spec, per="step")


class MixedPrecision_TrainingPolicy:  # noqa: N801 - the name users of the integer policies already write
    """The integer-policy interface: 0 = time, 1 = time + learning rate, 2 = loss, per epoch.

    Policy 1 requires `hold_time`, and its `enable_mixed_precision` calls require `lr`; policy 2
    calls require `loss` (the previous epoch's). `end_time=None` runs to the end of training.
    """

    POLICIES = {0: "time", 1: "lr", 2: "loss"}

    def __init__(
        self,
        policy: int,
        start_time: int = 10,
        end_time: int | None = None,
        hold_time: int | None = None,
        interval_time: int = 1000,
        interval_hold_time: int = 100,
    ):
        if isinstance(policy, bool) or policy not in self.POLICIES:
            raise ValueError(f"invalid policy={policy!r}; accepted: 0 (time), 1 (time + learning rate), 2 (loss)")
        if policy == 1 and hold_time is None:
            raise ValueError(
                "policy 1 (time + learning rate) requires hold_time: "
                "the epochs of full precision after a learning-rate change"
            )
        self.policy = policy
        self._policy = PrecisionPolicy(
            self.POLICIES[policy],
            start=start_time,
            end=end_time,
            hold=1 if hold_time is None else hold_time,
            per="epoch",
            interval=interval_time if policy == 2 else None,
            interval_hold=interval_hold_time if policy == 2 else None,
        )

    def enable_mixed_precision(
        self, epoch: int, scaler: Any = None, lr: float | None = None, loss: float | torch.Tensor | None = None
    ) -> bool:
        """Whether to autocast in this epoch."""
        if isinstance(scaler, (int, float)) and not isinstance(scaler, bool):
            raise TypeError(
                f"scaler={scaler!r} is a number: pass the GradScaler as scaler=, and lr= and loss= by keyword"
            )
        if self.policy == 1 and lr is None:
            raise ValueError("policy 1 (time + learning rate) requires lr= (this epoch's learning rate)")
        if self.policy == 2 and loss is None:
            raise ValueError("policy 2 (loss) requires loss= (the previous epoch's loss)")
        return self._policy.enabled(epoch=epoch, lr=lr, loss=loss, scaler=scaler)

    def state_dict(self) -> dict[str, Any]:
        return self._policy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._policy.load_state_dict(state)
