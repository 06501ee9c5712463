"""Per-step DDP whose survivors train on: `on_lost_replica=continue` without `sync_every`.

Each step's gradients are averaged among the replicas present (every rank is one), as DDP averages them over the
whole job, but through the membership of `resilience.membership`: a roll call, the exchange, a vote, decided in the
job's store. A replica lost before or during a step's exchange (dead, frozen or cut off) is dropped, and the step's
exchange is done again among the others from the same gradients, so that every survivor applies the same average
and the replicas stay equal. The exchange is flat, in float32, over Gloo groups of the members (as the syncs' are).

Memory: a copy of the step's gradients (4 bytes per trainable float32 parameter) is kept until the step's exchange
is decided, so that a try that failed can be done again from the same inputs; a try's sum takes as much again.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainaccel.comm.diloco import refuse_what_reaches_other_replicas
from trainaccel.comm.scheduler import SYNC, engine_group, sync_thread
from trainaccel.config import Config
from trainaccel.context import info_once
from trainaccel.observer import observer_of
from trainaccel.resilience import failfast
from trainaccel.resilience.failfast import HANG_MIN_S, hang_deadline
from trainaccel.resilience.membership import Membership

RECENT_STEPS = 20  # step times kept for hang_timeout=auto's deadline


class StepSurvivors:
    """State of the hook that averages a DDP model's gradients among the replicas present, once per step."""

    __slots__ = {
        "membership": "the replicas taking part (global ranks), their group and the store that decides both",
        "steps": "steps whose exchange was decided: the next one's name in the store",
        "bytes_sent": "bytes this rank handed to the exchanges' successful tries (float32 gradients)",
        "_pending": "this step's buckets so far: (bucket buffer, its future), completed at the last bucket",
        "_hang_timeout": "hang_timeout: how long a member alive but absent is waited for (auto: from step times)",
        "_step_s": "recent seconds between two steps' last buckets (hang_timeout=auto's deadline)",
        "_last": "when the last step's last bucket came (monotonic), or None",
    }

    def __init__(self, model: DistributedDataParallel, config: Config):
        group = model.process_group or dist.group.WORLD
        self.membership = Membership(engine_group(group, SYNC), config.collective_timeout)
        failfast.survive_lost_peers()
        self.steps, self.bytes_sent = 0, 0
        self._pending: list[tuple[torch.Tensor, torch.futures.Future]] = []
        self._hang_timeout = config.hang_timeout
        self._step_s: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self._last: float | None = None

    def bytes_per_step(self) -> float:
        return self.bytes_sent / max(self.steps, 1)

    def hang_s(self) -> float | None:
        """How long a step's exchange waits for a member alive but absent (hang_timeout; auto: from step times)."""
        steps = sorted(self._step_s)
        hang_s = hang_deadline(self._hang_timeout, [steps[len(steps) // 2] if steps else None])
        return HANG_MIN_S if hang_s is None and self._hang_timeout == "auto" else hang_s

    def exchange_step(self) -> torch.futures.Future:
        """Average this step's buckets among the members, on the syncs' thread; the buckets' futures complete then."""
        pending, self._pending = self._pending, []
        now = time.monotonic()
        if self._last is not None:
            self._step_s.append(now - self._last)
        self._last = now
        buffers = [buffer for buffer, _ in pending]
        # The step's gradients, kept apart from the buckets: every try sums the same inputs.
        kept = torch.cat([b.detach().reshape(-1).float() for b in buffers])
        name, hang_s, membership = f"step@{self.steps}", self.hang_s(), self.membership
        self.steps += 1

        def exchange(group: Any, members: int) -> torch.Tensor:
            total = kept.div(members)
            dist.all_reduce(total, group=group)
            return total

        def job() -> torch.Tensor:
            mean = membership.run(name, exchange, hang_s)
            self.bytes_sent += mean.numel() * mean.element_size()
            offset = 0
            for buffer in buffers:
                buffer.copy_(mean[offset : offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()
            return mean

        done = sync_thread().submit(job, kept.device)

        def settle(fut: torch.futures.Future) -> None:
            error = None
            try:
                fut.value()
            except Exception as e:  # (Dropped: the others went on without this rank; said by every bucket's wait)
                error = e
            for buffer, bucket_fut in pending:
                if error is None:
                    bucket_fut.set_result(buffer)
                else:
                    bucket_fut.set_exception(error)

        done.add_done_callback(settle)
        return done


def _average_among_members(state: StepSurvivors, bucket):  # noqa: ANN202 (DDP checks the annotations, strings here)
    """A DDP bucket's future, completed once the step's last bucket is averaged among the members with the rest."""
    buffer = bucket.buffer()
    # A CUDA-aware future makes DDP's wait order its stream after the job's copies, as c10d's futures do.
    fut: torch.futures.Future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else [])
    state._pending.append((buffer, fut))
    if bucket.is_last():
        state.exchange_step()
    return fut


def attach(model: DistributedDataParallel, config: Config) -> StepSurvivors:
    """Average `model`'s gradients among the replicas present at each step (on_lost_replica=continue, per step)."""
    if failfast.incarnation() > 0:
        raise ValueError(
            "a replica started again cannot rejoin per-step training yet (on_lost_replica=continue without "
            "sync_every): the others train on without it; rejoining works under sync_every"
        )
    if model.find_unused_parameters and not model.static_graph:
        raise ValueError(
            "on_lost_replica=continue cannot train a DDP model built with find_unused_parameters=True: DDP "
            "all-reduces its map of used parameters over every worker at every step, which would wait for a lost "
            "replica forever; build it with static_graph=True (the map is found once)"
        )
    refuse_what_reaches_other_replicas(model, "rank")
    if model.broadcast_buffers and any(True for _ in model.module.buffers()):
        # DDP broadcasts rank 0's buffers over its whole group at every forward: that would wait for a lost rank.
        model.broadcast_buffers = False
        info_once(
            "on_lost_replica=continue: DDP's broadcast of rank 0's buffers at each forward is off (it would wait for "
            "a lost replica); each replica keeps its own buffers (e.g. BatchNorm's running statistics)"
        )
    state = StepSurvivors(model, config)
    model.register_comm_hook(state, _average_among_members)
    observer_of(model).survivors = state
    info_once(
        "on_lost_replica=continue: each step's gradients are averaged among the replicas present; a lost one is "
        "dropped and that step's exchange done again among the others"
    )
    return state
