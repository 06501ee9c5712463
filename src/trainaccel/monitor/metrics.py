"""`StepMeter`: examples/s per worker and in total, step time split into data wait and compute, peak memory.

Every `every` steps the ranks pool their window (one all-reduce) and rank 0 logs one line, and optionally
appends it to a JSON-lines file or a TensorBoard log.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from trainaccel.devices import group_device

log = logging.getLogger("trainaccel")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One logged window: rates over all workers, times as each worker's mean per step."""

    step: int
    examples_per_s_per_worker: float
    examples_per_s: float
    step_time_s: float
    data_time_s: float
    compute_time_s: float
    peak_memory_bytes: int
    workers: int

    def line(self) -> str:
        return (
            f"step {self.step} | {self.examples_per_s_per_worker:,.1f} examples/s per worker, "
            f"{self.examples_per_s:,.1f} total ({self.workers} workers) | step {self.step_time_s * 1e3:.1f} ms: "
            f"data {self.data_time_s * 1e3:.1f} ms, compute {self.compute_time_s * 1e3:.1f} ms | "
            f"peak memory {self.peak_memory_bytes / 2**20:,.0f} MiB"
        )


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak CUDA memory allocated on `device`, else the process's peak resident set."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class StepMeter:
    """Call `step(batch_size)` at the end of each training step; iterate the data through `wrap()` to time it."""

    def __init__(
        self,
        every: int = 100,
        *,
        jsonl: str | os.PathLike | None = None,
        tensorboard: str | os.PathLike | None = None,
        device: torch.device | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        logs_here: Callable[[], bool] | None = None,
    ):
        """`logs_here`: None pools every worker's figures over `process_group` and logs them on its first rank; else
        each worker's own figures are kept, logged where it says (a group that may hold a lost rank is never used)."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"invalid every {every!r}; accepted: an integer >= 1 (steps between lines)")
        self.every = every
        self.device = torch.device(device) if device is not None else None
        self.group = process_group
        self._logs_here = logs_here
        self.records: list[StepRecord] = []  # the lines logged so far, on every rank
        self.steps = 0
        self._jsonl = Path(jsonl) if jsonl is not None else None
        self._writer = _tensorboard(tensorboard) if tensorboard is not None and self._logging() else None
        self._last = time.perf_counter()
        self._data = 0.0  # data wait inside the current step
        self._window = [0.0, 0.0, 0.0, 0.0]  # examples, step seconds, data seconds, steps

    def wrap(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Yield from `batches`, counting the wait for each as data time."""
        iterator = iter(batches)
        self.restart()
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._data += time.perf_counter() - start
            yield batch

    def restart(self) -> None:
        """Start the next step's clock now (after an evaluation pause, say)."""
        self._last, self._data = time.perf_counter(), 0.0

    def step(self, batch_size: int, data_time: float | None = None) -> StepRecord | None:
        """Close a step of `batch_size` examples; every `every` steps, pool and log a record (collective)."""
        now = time.perf_counter()
        data = self._data if data_time is None else data_time
        window = self._window
        window[0] += batch_size
        window[1] += now - self._last
        window[2] += min(data, now - self._last)
        window[3] += 1
        self._last, self._data = now, 0.0
        self.steps += 1
        if window[3] < self.every:
            return None
        record = self._pool()
        self._window = [0.0, 0.0, 0.0, 0.0]
        self.records.append(record)
        if self._logging():
            self._emit(record)
        return record

    def _logging(self) -> bool:
        return rank_in(self.group) == 0 if self._logs_here is None else self._logs_here()

    def _pool(self) -> StepRecord:
        sums = torch.tensor(self._window, dtype=torch.float64)
        peak = torch.tensor([float(peak_memory_bytes(self.device))], dtype=torch.float64)
        workers = 1
        if self._logs_here is None and dist.is_available() and dist.is_initialized():
            workers = dist.get_world_size(self.group)
            device = group_device(self.group)
            sums, peak = sums.to(device), peak.to(device)
            dist.all_reduce(sums, group=self.group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        examples, seconds, data, steps = sums.tolist()
        step_time = seconds / steps  # each worker's mean step, averaged over workers
        total = examples / (seconds / workers)
        return StepRecord(
            step=self.steps,
            examples_per_s_per_worker=total / workers,
            examples_per_s=total,
            step_time_s=step_time,
            data_time_s=data / steps,
            compute_time_s=step_time - data / steps,
            peak_memory_bytes=int(peak.item()),
            workers=workers,
        )

    def _emit(self, record: StepRecord) -> None:
        log.info("%s", record.line())
        if self._jsonl is not None:
            with self._jsonl.open("a") as f:
                f.write(json.dumps(dataclasses.asdict(record)) + "\n")
        if self._writer is not None:
            for name, value in dataclasses.asdict(record).items():
                if name != "step":
                    self._writer.add_scalar(f"trainaccel/{name}", value, record.step)
            self._writer.flush()


def rank_in(group: dist.ProcessGroup | None) -> int:
    """This process's rank in `group` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _tensorboard(directory: str | os.PathLike) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError("StepMeter(tensorboard=...) needs the tensorboard package: pip install tensorboard") from e
    return SummaryWriter(str(directory))
