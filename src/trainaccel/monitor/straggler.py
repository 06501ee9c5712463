"""Straggler detection: every N steps the workers share their own step times; the slow ones are named.

In synchronous training every worker's step takes as long as the slowest one's, so what is
compared is each worker's *own* time per step: its step time less the time it spent waiting
for its peers in collectives. A worker slower than the median by more than `threshold` is
named on rank 0 with its host and local rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
from typing import Iterator

import torch
import torch.distributed as dist

from trainaccel.devices import group_device
from trainaccel.environment import worker_place
from trainaccel.monitor.metrics import rank_in

log = logging.getLogger("trainaccel")


@dataclasses.dataclass(frozen=True)
class Straggler:
    """One worker named by a check."""

    rank: int
    host: str
    local_rank: int
    own_time_s: float  # its own work per step, waits for peers excluded
    median_s: float  # the median of every worker's own time per step

    @property
    def slower(self) -> float:
        """How much slower than the median: 0.5 is 50%."""
        return self.own_time_s / self.median_s - 1.0

    def describe(self) -> str:
        return (
            f"rank {self.rank} (host {self.host}, local rank {self.local_rank}) is {self.slower:.0%} slower than "
            f"the median: {self.own_time_s * 1e3:.1f} ms vs {self.median_s * 1e3:.1f} ms of own work per step"
        )


@dataclasses.dataclass(frozen=True)
class StragglerReport:
    """One check: every worker's own time per step over the window, and the stragglers among them."""

    step: int
    own_times_s: tuple[float, ...]  # by rank
    stragglers: tuple[Straggler, ...]


class StragglerDetector:
    """Call `step()` at the end of each training step; wrap waits for peers in `waiting()` (collective checks)."""

    def __init__(
        self,
        every: int = 100,
        threshold: float = 0.2,
        *,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"invalid every {every!r}; accepted: an integer >= 1 (steps between checks)")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
            raise ValueError(
                f"invalid threshold {threshold!r}; accepted: a number > 0 (0.2: 20% slower than the median)"
            )
        self.every, self.threshold, self.group = every, float(threshold), process_group
        self.device = torch.device(device) if device is not None else None
        self.reports: list[StragglerReport] = []  # every check so far, on every rank
        self.steps = 0
        self._places: list[tuple[str, int]] | None = None  # (host, local rank) by rank, gathered at the first check
        self._window_own, self._window_steps = 0.0, 0
        self.restart()

    def restart(self) -> None:
        """Start the next step's clock now (after an evaluation pause, say)."""
        self._last, self._waited = time.perf_counter(), 0.0

    def waited(self, seconds: float) -> None:
        """Exclude `seconds` spent waiting for peers from the current step's own time."""
        self._waited += max(0.0, seconds)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time spent inside is waiting for peers (a blocking collective, say), not own work."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.waited(time.perf_counter() - start)

    def step(self, own_time_s: float | None = None) -> StragglerReport | None:
        """Close a step (own time: since the last step, less the waits); every `every` steps, check (collective)."""
        now = time.perf_counter()
        own = now - self._last - self._waited if own_time_s is None else own_time_s
        self._window_own += max(0.0, own)
        self._window_steps += 1
        self.steps += 1
        self._last, self._waited = now, 0.0
        if self._window_steps < self.every:
            return None
        report = self._check(self._window_own / self._window_steps)
        self._window_own, self._window_steps = 0.0, 0
        self.restart()  # the check waited for every worker: that wait is nobody's own time
        return report

    def _check(self, own: float) -> StragglerReport:
        times, places = [own], [worker_place()]
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size(self.group)
            if self._places is None:
                places = [("", 0)] * world
                dist.all_gather_object(places, worker_place(), group=self.group)
            mine = torch.tensor([own], dtype=torch.float64, device=group_device(self.group))
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine, group=self.group)
            times = [t.item() for t in gathered]
        self._places = self._places or places
        median = statistics.median(times)
        slow = tuple(
            Straggler(rank, *self._places[rank], own_time_s=t, median_s=median)
            for rank, t in enumerate(times)
            if median > 0 and t > median * (1 + self.threshold)
        )
        report = StragglerReport(self.steps, tuple(times), slow)
        self.reports.append(report)
        if rank_in(self.group) == 0:
            log.debug(
                "straggler check at step %d: own work per step by rank: %s ms (median %.1f ms)",
                self.steps,
                ", ".join(f"{t * 1e3:.1f}" for t in times),
                median * 1e3,
            )
            for straggler in slow:
                log.warning("straggler at step %d: %s", self.steps, straggler.describe())
        return report
