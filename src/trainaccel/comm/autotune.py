"""`autotune=on`: time each candidate reduction over a few training steps, keep the fastest.

Candidates differ in how gradients travel, never in what the user allowed: the configured
codec and, when it is lossy, no compression (compression is used only where it pays); flat or
hierarchical when the job has several nodes; and the size of the pieces the hierarchy works in.
Every rank switches candidates at the same step; rank 0 times them and broadcasts its choice.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.

import dataclasses
import logging
import statistics
from typing import Any, Optional

import torch
import torch.distributed as dist

from trainaccel.comm import clock
from trainaccel.comm.hooks import CommState, trainaccel_comm_hook
from trainaccel.comm.powersgd import START_STEP
from trainaccel.comm.scheduler import comm_thread
from trainaccel.comm.topology import release
from trainaccel.config import Config

log = logging.getLogger("trainaccel")

TRIAL_STEPS = 3  # timed steps per candidate, after its warm-up step(s)
CHUNK_CANDIDATES_MB = (1.0, 4.0, 16.0)


@dataclasses.dataclass
class Candidate:
    label: str
    state: CommState
    warmup: int  # untimed steps: the first step after a switch pays for allocations


def candidate_configs(config: Config, multi_node: bool) -> list[tuple[str, Config, Optional[float]]]:
    """(label, config, hierarchy chunk MiB) for every reduction worth timing under `config`."""
    codecs = [config.compression] + (["none"] if config.compression != "none" else [])
    out: list[tuple[str, Config, Optional[float]]] = []
    for codec in codecs:
        base = dataclasses.replace(config, compression=codec, autotune="off")
        if not multi_node or codec == "powersgd":
            out.append((codec, base, None))
            continue
        if config.hierarchical != "on":
            out.append((f"{codec} flat", dataclasses.replace(base, hierarchical="off"), None))
        if config.hierarchical != "off":
            for chunk in CHUNK_CANDIDATES_MB:
                label = f"{codec} hierarchical {chunk:g} MiB"
                out.append((label, dataclasses.replace(base, hierarchical="on"), chunk))
    return out


def choose(times: dict[str, list[float]]) -> str:
    """The candidate with the lowest median step time (the first one on a tie)."""
    return min(times, key=lambda label: statistics.median(times[label]))


class Autotuner:
    """Hook state that runs candidates one after another, then the chosen one for good."""

    def __init__(self, candidates: list[Candidate], process_group: Optional[dist.ProcessGroup]):
        if not candidates:
            raise ValueError("autotune needs at least one candidate")
        self.candidates, self.process_group = candidates, process_group
        # Each timed step as clock marks (on the gradients' stream: on a GPU the host only queues the work), read
        # when the choice is made.
        self.times: dict[str, list[tuple[Any, Any]]] = {c.label: [] for c in candidates}
        self.chosen: Optional[Candidate] = None if len(candidates) > 1 else candidates[0]
        self._index = 0
        self._steps_on_current = 0
        self._last_boundary: Any = None
        self._switch_pending = False

    @property
    def current(self) -> Candidate:
        return self.chosen or self.candidates[self._index]

    def bytes_per_step(self) -> float:
        return self.current.state.bytes_per_step()

    @property
    def bytes_sent(self) -> int:
        """Cross-node payload bytes of every candidate so far."""
        return sum(c.state.bytes_sent for c in self.candidates)

    @property
    def hierarchical(self) -> bool:
        return self.current.state.hierarchical

    def before_bucket(self, bucket: dist.GradBucket) -> CommState:
        """Advance the schedule at step boundaries; the state that reduces this bucket."""
        if self._switch_pending and bucket.index() == 0:
            self._switch_pending = False
            self._next(bucket.buffer().device)
        return self.current.state

    def after_bucket(self, bucket: dist.GradBucket) -> None:
        if self.chosen is not None or not bucket.is_last():
            return
        # The last bucket's reduction waited for by the next step's (DDP's finalize makes the stream wait for it):
        # from one step's last bucket to the next's is a whole step, its reductions included.
        now = clock.mark(bucket.buffer().device)
        candidate = self.candidates[self._index]
        if self._last_boundary is not None and self._steps_on_current > candidate.warmup:
            self.times[candidate.label].append((self._last_boundary, now))
        self._last_boundary = now
        self._steps_on_current += 1
        if self._steps_on_current >= candidate.warmup + 1 + TRIAL_STEPS:
            self._switch_pending = True  # at the next step's first bucket, the same step on every rank

    def _next(self, device: torch.device) -> None:
        self._steps_on_current, self._last_boundary = 0, None
        if self._index + 1 < len(self.candidates):
            self._index += 1
            return
        # Rank 0's timings decide; every rank applies the same choice, sent on the engine's thread and group (DDP's
        # own group is issued on from the training thread).
        group = self.candidates[0].state.group
        seconds = {label: [clock.seconds(*span, wait=True) for span in spans] for label, spans in self.times.items()}
        decision = torch.tensor([self._choice_index(seconds)], dtype=torch.int64, device=device)

        def send() -> torch.Tensor:
            dist.broadcast(decision, src=dist.get_global_rank(group, 0), group=group)
            return decision

        self.chosen = self.candidates[int(comm_thread().run(send, device, (group,)).item())]
        for candidate in self.candidates:  # the losers' two-level groups, where nothing else uses them, are freed
            hierarchy = candidate.state.hierarchy
            if candidate is not self.chosen and hierarchy is not None and release(hierarchy.topology):
                log.info("autotune: the hierarchy's groups, used by no candidate kept, are destroyed")
        if dist.get_rank(group) == 0:
            tried = ", ".join(
                f"{label} {statistics.median(t):.3f} s" if t else f"{label} -" for label, t in seconds.items()
            )
            log.info("autotune chose %s (median step time; tried: %s)", self.chosen.label, tried)

    def _choice_index(self, seconds: dict[str, list[float]]) -> int:
        timed = {label: t for label, t in seconds.items() if t}
        label = choose(timed) if timed else self.candidates[0].label
        return next(i for i, c in enumerate(self.candidates) if c.label == label)


def autotune_comm_hook(state: Autotuner, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """trainaccel's hook with the reduction of the candidate on trial (or the chosen one)."""
    fut = trainaccel_comm_hook(state.before_bucket(bucket), bucket)
    state.after_bucket(bucket)
    return fut


def warmup_steps(config: Config) -> int:
    """Untimed steps before a candidate is timed: its exact warm-up steps (compression_warmup), then one."""
    if config.compression == "powersgd":
        return max(START_STEP, config.compression_warmup) + 1
    return max(1, config.compression_warmup) + 1 if config.compression in ("topk", "randomk") else 1
