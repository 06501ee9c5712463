"""Adaptive ratio for topk and randomk: measure the compression error, send more when it grows, less when safe.

Every `every` exchanges of a bucket, the engine sums two numbers over the workers (one tiny
allreduce): the squared norm of what waits in the residuals, and of the step's gradient. Their
ratio's square root, the *lag*, says how many steps' worth of gradient error feedback holds
back. Above `HIGH` the bucket's ratio doubles (up to `compression_ratio_max`), below `LOW` it
halves (down to `compression_ratio`). Every worker sees the same sums, so every worker switches
alike, at the same step. In the spirit of Accordion (Agarwal et al., ICLR 2021), which sends
more in the critical phases of training and less elsewhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

HIGH, LOW = 8.0, 2.0  # lag thresholds, in steps of gradient held back
EVERY = 10  # exchanges of a bucket between two measurements


class AdaptiveRatio:
    """The ratio of each bucket (by key), between `low` and `high`; state per key: [ratio, exchanges]."""

    def __init__(self, low: float, high: float, every: int = EVERY):
        if not 0 < low < high <= 1:
            raise ValueError(f"invalid adaptive ratio bounds ({low}, {high}); accepted: 0 < low < high <= 1")
        self.low, self.high, self.every = low, high, every
        self.ratios: dict[Any, list] = {}  # a bucket store (see trainaccel.comm.buckets): equal on every rank

    def ratio(self, key: Any) -> float:
        entry = self.ratios.get(key)
        return self.low if entry is None else entry[0]

    def measure(
        self, key: Any, residual: torch.Tensor, gradient: torch.Tensor, scale: float, group: dist.ProcessGroup
    ) -> None:
        """After an exchange of `key`: every `every` of them, move its ratio by the summed lag (collective)."""
        entry = self.ratios.setdefault(key, [self.low, 0])
        entry[1] += 1
        if entry[1] % self.every:
            return
        norms = torch.stack([residual.float().square().sum(), gradient.float().square().sum() * scale * scale])
        dist.all_reduce(norms, group=group)
        held, step = float(norms[0]), float(norms[1])
        if not (math.isfinite(held) and math.isfinite(step)) or step == 0:
            return
        lag = math.sqrt(held / step)
        if lag > HIGH:
            entry[0] = min(self.high, entry[0] * 2)
        elif lag < LOW:
            entry[0] = max(self.low, entry[0] / 2)
