"""Per-step DDP whose survivors train on: `on_lost_replica=continue` without `sync_every`.

Each step's gradients are averaged among the replicas present (every rank is one), as DDP averages them over the
whole job, but through the membership of `resilience.membership`: a roll call, the exchange, a vote, decided in the
job's store. A replica lost before or during a step's exchange (dead, frozen or cut off) is dropped, and the step's
exchange is done again among the others from the same gradients, so that every survivor applies the same average
and the replicas stay equal. The exchange is flat, in float32, over Gloo groups of the members (as the syncs' are).

A replica started again (its rank's next incarnation, `resilience.rejoin`) asks to join as DDP wraps its model; the
members admit it at the start of a step's exchange and a live one sends it the parameters and buffers it trains the
step from, and its optimizers' state for its first optimizer step: from then on it is a member like the others.

Memory: a copy of the step's gradients (4 bytes per trainable float32 parameter) is kept until the step's exchange
is decided, so that a try that failed can be done again from the same inputs; a try's sum takes as much again.
"""

from __future__ import annotations

import collections
import functools
import io
import logging
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainaccel import context
from trainaccel.comm.diloco import optimizer_state_by_index, refuse_what_reaches_other_replicas, take_optimizer_state
from trainaccel.comm.scheduler import SYNC, engine_group, sync_thread
from trainaccel.config import Config
from trainaccel.context import info_once, say_once
from trainaccel.observer import observer_of, watch_optimizer_steps
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
        "_pending": "this step's buckets so far: (bucket buffer, its parameters' indices, its future), completed at "
        "the last bucket",
        "_index": "each trainable parameter's index in the model (by id): the exchange's order",
        "_hang_timeout": "hang_timeout: how long a member alive but absent is waited for (auto: from step times)",
        "_step_s": "recent seconds between two steps' last buckets (hang_timeout=auto's deadline)",
        "_last": "when the last step's last bucket came (monotonic), or None",
        "rejoined_at": "steps the members had taken when this replica rejoined them (0: it never left)",
        "_model": "the DDP model (weakly): its parameters and buffers are what a joiner takes",
        "_holders": "the optimizers seen stepping the model: their state is what a joiner's optimizers take",
        "_joined_state": "a joiner's optimizer state from a live member, by parameter index, until its optimizers "
        "took it at their first step",
        "__weakref__": "so that the process-wide table of live states does not keep one alive",
    }

    def __init__(self, model: DistributedDataParallel, config: Config):
        group = model.process_group or dist.group.WORLD
        self.membership = Membership(engine_group(group, SYNC), config.collective_timeout)
        failfast.survive_lost_peers()
        self.steps, self.bytes_sent, self.rejoined_at = 0, 0, 0
        self._model = weakref.ref(model)
        self._holders: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._joined_state: dict[int, dict] = {}
        self._pending: list[tuple[torch.Tensor, list[int], torch.futures.Future]] = []
        self._index = {id(p): i for i, p in enumerate(model.parameters())}
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
        # Each parameter's gradient, in the model's order of parameters: DDP orders its buckets by when gradients
        # became ready, learned in a replica's first step, so a replica that rejoined (in its first step) holds them
        # in another order than the others.
        slices = []  # (parameter index, bucket buffer, offset there, size)
        for buffer, indices, _ in pending:
            offset = 0
            for index, size in indices:
                slices.append((index, buffer, offset, size))
                offset += size
        slices.sort(key=lambda piece: piece[0])
        # The step's gradients, kept apart from the buckets: every try sums the same inputs.
        kept = torch.cat([buffer[o : o + n].detach().float() for _, buffer, o, n in slices])
        steps, hang_s, membership = self.steps, self.hang_s(), self.membership
        name = f"step@{steps}"
        self.steps += 1

        def exchange(group: Any, members: int) -> torch.Tensor:
            total = kept.div(members)
            dist.all_reduce(total, group=group)
            return total

        def job() -> torch.Tensor:
            # Ranks started again and asking to join (a store read each step), except at the step this replica
            # joined at: it was admitted there.
            joiners = membership.joiners_at(name) if not self.rejoined_at or steps != self.rejoined_at else {}
            if joiners:  # before this step's exchange: they train this step from the members' parameters
                membership.admit(name, joiners, functools.partial(self._join_state, steps), hang_s)
            mean = membership.run(name, exchange, hang_s)
            self.bytes_sent += mean.numel() * mean.element_size()
            at = 0
            for _, buffer, offset, size in slices:
                buffer[offset : offset + size].copy_(mean[at : at + size])
                at += size
            return mean

        done = sync_thread().submit(job, kept.device)

        def settle(fut: torch.futures.Future) -> None:
            error = None
            try:
                fut.value()
            except Exception as e:  # (Dropped: the others went on without this rank; said by every bucket's wait)
                error = e
            for buffer, _, bucket_fut in pending:
                if error is None:
                    bucket_fut.set_result(buffer)
                else:
                    bucket_fut.set_exception(error)

        done.add_done_callback(settle)
        return done

    # -- a replica started again ------------------------------------------------------------------------------

    def note_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Before an optimizer's step: learn it if it steps the model; a joiner's takes a live member's state."""
        model = self._model()
        if model is None or not any(observer_of(model).holds(p) for g in optimizer.param_groups for p in g["params"]):
            return
        self._holders.add(optimizer)
        if self._joined_state:
            take_optimizer_state(optimizer, list(model.parameters()), self._joined_state)

    def _join_state(self, steps: int) -> bytes:
        """What a replica rejoining takes from this one, as the members begin the exchange of their step `steps` + 1
        (during its backward, before its optimizer step): the parameters and buffers that step trains from, and the
        optimizers' state by parameter index."""
        model = self._model()
        params = list(model.parameters())
        state = {
            "params": [p.detach() for p in params],
            "buffers": [b.detach() for b in model.buffers()],
            "optimizers": optimizer_state_by_index(list(self._holders), params),
            "steps": steps,
        }
        out = io.BytesIO()
        torch.save(state, out)
        return out.getvalue()

    def rejoin(self, model: DistributedDataParallel, hang_s: float | None) -> None:
        """This rank was started again: wait until the members admit it, then take a live member's parameters and
        buffers now, and its optimizers' state at their first step."""
        failfast.start_heartbeat()  # beating before it asks: the members judge it by its heartbeat
        state = torch.load(io.BytesIO(self.membership.join(hang_s)), map_location="cpu", weights_only=True)
        with torch.no_grad():
            for param, value in zip(model.parameters(), state["params"]):
                param.copy_(value)
            for buffer, value in zip(model.buffers(), state["buffers"]):
                buffer.copy_(value)
        self._joined_state = state["optimizers"]
        self.steps = self.rejoined_at = state["steps"]
        say_once(
            logging.INFO, f"rejoined the running job at step {self.steps} with {self.membership.size} replicas", True
        )


def _average_among_members(state: StepSurvivors, bucket):  # noqa: ANN202 (DDP checks the annotations, strings here)
    """A DDP bucket's future, completed once the step's last bucket is averaged among the members with the rest."""
    buffer = bucket.buffer()
    # A CUDA-aware future makes DDP's wait order its stream after the job's copies, as c10d's futures do.
    fut: torch.futures.Future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else [])
    # The bucket's buffer holds its parameters' gradients one after the other, in the order of `parameters()`.
    indices = [(state._index[id(p)], p.numel()) for p in bucket.parameters()]
    state._pending.append((buffer.view(-1), indices, fut))
    if bucket.is_last():
        state.exchange_step()
    return fut


def attach(model: DistributedDataParallel, config: Config) -> StepSurvivors:
    """Average `model`'s gradients among the replicas present at each step (on_lost_replica=continue, per step); a
    replica started again rejoins the running job here (as DDP wraps its model, before the script's loop)."""
    existing = observer_of(model).survivors
    if existing is not None:
        return existing
    refuse_what_reaches_other_replicas(model, "rank", per_step=True)
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
    watch_optimizer_steps(before=_note_optimizer)
    if context.first_time("per-step survivors"):
        context.on_undo("per-step survivors", _live.clear)
    _live.add(state)
    info_once(
        "on_lost_replica=continue: each step's gradients are averaged among the replicas present; a lost one is "
        "dropped and that step's exchange done again among the others"
    )
    if failfast.incarnation() > 0:
        state.rejoin(model, state.hang_s())
    return state


_live: weakref.WeakSet[StepSurvivors] = weakref.WeakSet()  # every model's, for the optimizer-step watcher


def _note_optimizer(optimizer: torch.optim.Optimizer) -> None:
    for state in list(_live):
        state.note_optimizer(optimizer)
