"""Time where the work runs: the host's clock for CPU work, CUDA events for a GPU's.

A collective on a GPU returns once it is queued (NCCL, and every job of the engine's communication thread on its
stream): the host's clock around it measures the queueing, not the transfer. `mark` records an event on the device's
current stream instead, and `seconds` reads two marks once the device has passed them, without waiting unless asked.
"""

from __future__ import annotations

import time
from typing import Any

import torch

Mark = Any  # a float (host seconds) or a torch.cuda.Event recorded with timing


def mark(device: torch.device | None) -> Mark:
    """Now, on `device`'s current stream (the host's clock for a CPU device or None)."""
    if device is None or device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def seconds(start: Mark, end: Mark, wait: bool = False) -> float | None:
    """Seconds from `start` to `end`; None while the device has not passed `end` yet (unless `wait`: then it waits)."""
    if isinstance(start, float):
        return max(0.0, end - start)
    if not end.query():
        if not wait:
            return None
        end.synchronize()
    return max(0.0, start.elapsed_time(end) / 1000.0)
