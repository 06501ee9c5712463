"""trainaccel's DDP communication hook: encode each bucket, reduce it (flat or hierarchical), decode, check it."""
# No `from __future__ import annotations`: DDP checks this hook's annotations at runtime.

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from trainaccel.comm import clock
from trainaccel.comm.buckets import LOCAL_STORES, Signature, bucket_stores, follow_bucket, holds_state_for
from trainaccel.comm.codecs import Codec, ErrorFeedback
from trainaccel.comm.exchange import EXACT, NOT_FINITE, all_finite, all_gather_single, say_fallback, start_exchange
from trainaccel.comm.exit_guard import track
from trainaccel.comm.hierarchical import HierarchicalReduce
from trainaccel.comm.momentum import MovedMomentum, bucket_velocity
from trainaccel.comm.powersgd import PowerSGDState, forget_bucket, powersgd_reduce
from trainaccel.comm.scheduler import before_ddp_unused_map, comm_thread
from trainaccel.context import log, warn_once
from trainaccel.devices import backend_of
from trainaccel.monitor import timeline

# Backends whose allreduce takes a sparse tensor: Gloo alone (NCCL raises, MPI refuses sparse input). Elsewhere sparse
# gradients are averaged by all-gathering their indices and values, with the same result (`_sparse_mean`).
SPARSE_ALLREDUCE_BACKENDS = ("gloo",)


@dataclasses.dataclass
class CommWait:
    """This worker's wait for its peers in one step: from its last bucket ready to its reductions done.

    On the CPU, host clock times. On a GPU the host only queues the work, so its times say nothing of the device's:
    CUDA events on the streams that produce the last bucket and consume the reductions are timed instead, and read
    at the next step if they completed (never waited for: no host sync).
    """

    ready: Any = None  # when the step's last bucket reached the hook (local work done): a time or a CUDA event
    done: Any = None  # when the latest of the step's reductions completed: a time or a CUDA event

    def take(self) -> float:
        """The last step's wait in seconds (0 if none was seen, or its device events are still pending), and forget
        it."""
        ready, done = self.ready, self.done
        self.ready = self.done = None
        if ready is None or done is None:
            return 0.0
        return clock.seconds(ready, done) or 0.0

    def mark_ready(self, device: torch.device) -> None:
        self.ready = clock.mark(device)

    def mark_done(self, fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()
        self.done = clock.mark(value.device)  # a CUDA future's callback runs on streams ordered after its work
        return value


@dataclasses.dataclass
class CommState:
    """What the hook keeps between buckets and steps on one worker.

    One of three reductions: torch's PowerSGD (`powersgd`), the two-level `hierarchy`, or one
    flat exchange of `codec` payloads over `group`. Every collective runs on the engine's
    communication thread, over groups of the engine's own (`group` copies `process_group`).
    """

    process_group: dist.ProcessGroup | None  # the DDP model's group
    codec: Codec
    group: dist.ProcessGroup | None = None  # the engine's copy of it: DDP's own collectives stay apart
    nan_check: str = "off"
    param_names: dict[int, str] = dataclasses.field(default_factory=dict)  # id(parameter) -> name, in model order
    param_index: dict[int, int] = dataclasses.field(default_factory=dict)  # id(parameter) -> its place in that order
    feedback: ErrorFeedback | None = None
    hierarchy: HierarchicalReduce | None = None
    powersgd: PowerSGDState | None = None
    flat_bytes_sent: int = 0
    reductions: int = 0  # steps whose last bucket this hook reduced (training steps are the observer's to count)
    fallbacks: int = 0  # lossy exchanges that were not finite and were redone exactly
    skipped_steps: int = 0  # steps whose gradients the script did not apply: residuals dropped after them
    optimizer_steps_at_last_step: int | None = -1  # the observer's optimizer steps at the last step's first bucket
    reductions_at_start: int = 0  # `reductions` when this process began (restored from a checkpoint, or 0)
    # Per-bucket state follows the parameters a bucket holds (see `trainaccel.comm.buckets`).
    signatures: dict[int, Signature] = dataclasses.field(default_factory=dict)  # bucket index -> its parameters
    parked: dict[Signature, dict] = dataclasses.field(default_factory=dict)  # state of buckets not at an index now
    # A restored checkpoint's buckets by the index they had: its first step is reduced in them (`_realign`).
    restored_buckets: dict[int, Signature] = dataclasses.field(default_factory=dict)
    realigning: list = dataclasses.field(default_factory=list)  # that step's buckets until its last one comes
    # Set by `register` when there is nothing to add to a plain allreduce (no codec, no hierarchy,
    # no check): DDP's own C++ allreduce runs instead of this hook, with no Python per bucket.
    builtin: bool = False
    dense_bytes_per_step: int = 0  # what that allreduce sends per step
    comm_wait: CommWait | None = None  # measured for straggler detection
    observer: Any = None  # the model's StepObserver: its optimizer steps tell a skipped step (set by `register`)
    warmup_steps: int = 0  # first steps reduced exactly before a sparse codec starts (compression_warmup)
    last_step_compressed: bool = False  # whether the last step's dense buckets went through the codec
    moved: MovedMomentum | None = None  # an optimizer's momentum, applied by error feedback (compression_momentum)
    # DDP all-reduces its unused-parameter map on its own group, from the training thread, right after the last
    # bucket's hook (find_unused_parameters): the hook first waits for its jobs, so that every rank issues the
    # engine's collectives and that one in the same order (NCCL may deadlock otherwise).
    ddp_collective_after_last: bool = False

    @property
    def groups(self) -> tuple:
        """The groups a bucket's job issues on (a job of DiLoCo's syncs may have issued on them last)."""
        return (self.group, *(self.hierarchy.groups if self.hierarchy is not None else ()))

    @property
    def hierarchical(self) -> bool:
        return self.hierarchy is not None

    @property
    def per_bucket(self) -> bool:
        """Whether anything is kept per bucket between steps (then it must follow the bucket's parameters)."""
        return bool(bucket_stores(self))

    @property
    def keeps_residuals(self) -> bool:
        """Whether a lossy codec keeps per-bucket state, which must not start before DDP's final buckets."""
        return self.feedback is not None or (
            self.hierarchy is not None
            and (self.hierarchy.feedback is not None or self.hierarchy.intra_feedback is not None)
        )

    @property
    def bytes_sent(self) -> int:
        """Payload bytes each worker receives from collectives that cross nodes (all of them when flat)."""
        return self.flat_bytes_sent + (self.hierarchy.bytes_sent if self.hierarchy is not None else 0)

    def bytes_per_step(self) -> float:
        """Average of `bytes_sent` per step (for DDP's own allreduce: the gradient's bytes)."""
        if self.builtin:
            return float(self.dense_bytes_per_step)
        return self.bytes_sent / self.reductions if self.reductions else 0.0


def trainaccel_comm_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket across workers through `state.codec` (hierarchically when set up).

    The work runs on the engine's communication thread; this returns at once.
    """
    # DDP builds its final buckets after this process's first step
    first_here = state.reductions == state.reductions_at_start
    if bucket.index() == 0 and (state.keeps_residuals or state.powersgd is not None):
        _drop_residuals_after_a_skipped_step(state)
    if bucket.is_last():
        state.reductions += 1
        if state.comm_wait is not None:
            state.comm_wait.mark_ready(bucket.buffer().device)
    step = state.reductions if bucket.is_last() else state.reductions + 1
    buffer, index = bucket.buffer(), bucket.index()
    signature = _signature(state, bucket) if state.per_bucket else None

    def job() -> torch.Tensor:
        if signature is not None:
            exact_first = first_here and state.keeps_residuals and not holds_state_for(state, index, signature)
            follow_bucket(state, index, signature)
        else:
            exact_first = False
        if buffer.is_sparse:
            if state.powersgd is not None:
                # torch's PowerSGD counts steps at its last bucket: if this is it, count here, or it never starts
                state.powersgd.maybe_increase_iter(bucket)
            by_gather = backend_of(state.group, buffer.device) not in SPARSE_ALLREDUCE_BACKENDS
            name = "sparse allgather" if by_gather else "sparse allreduce"
            return timeline.traced(name, index, lambda _: _sparse_mean(state, buffer, by_gather))(None)
        if state.powersgd is not None:
            return timeline.traced("powersgd", index, lambda _: _powersgd_bucket(state, bucket, step))(None)
        if exact_first or step <= state.warmup_steps:
            # DDP may rebuild its buckets in a new parameter order after its first step: residuals start after
            # it, and after the warm-up, whose exact steps keep a sparse codec from starting on the first gradients.
            state.last_step_compressed = False
            name = "allreduce (warm-up)" if not exact_first else "allreduce (before DDP's final buckets)"
            return timeline.traced(name, index, lambda _: _exact(state, buffer))(None)
        state.last_step_compressed = True
        velocity = bucket_velocity(state.moved, bucket, buffer) if state.moved is not None else None
        if state.hierarchy is not None:
            return _hierarchical(state, buffer, index, step, velocity)  # its stages trace themselves
        return _flat(state, buffer, index, step, velocity)  # `exchange` traces its stages

    def checked_job() -> torch.Tensor:
        # On the communication thread, as part of the job: a callback added to the future with then() would run on
        # the training thread whenever the job was done first, and its read of the result would stop that thread.
        result = job()
        _check_finite(state, bucket, result)
        return result

    if first_here and state.restored_buckets and step <= state.warmup_steps:
        state.restored_buckets.clear()  # restored during the warm-up: its exact steps need no realignment
    realign = first_here and state.restored_buckets and not buffer.is_sparse
    if realign:
        fut = _realign(state, bucket, step)
    else:
        fut = comm_thread().submit(job if state.nan_check == "off" else checked_job, buffer.device, state.groups)
    if bucket.is_last() and state.ddp_collective_after_last:
        before_ddp_unused_map(fut, state.process_group)
    if state.comm_wait is not None:
        fut = fut.then(track(state.comm_wait.mark_done))
    if state.nan_check == "off" or not realign:
        return fut

    def check(fut: torch.futures.Future) -> torch.Tensor:
        result = fut.value()
        _check_finite(state, bucket, result)
        return result

    return fut.then(track(check))


class _Bucket:
    """A bucket of the engine's making (a restored checkpoint's): what `GradBucket` offers torch's PowerSGD hook
    and the moved momentum (`bucket_velocity`)."""

    def __init__(
        self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor], last: bool, parameters: list = ()
    ):
        self._index, self._buffer, self._gradients, self._last = index, buffer, gradients, last
        self._parameters = list(parameters)

    def parameters(self) -> list:
        return self._parameters

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def is_last(self) -> bool:
        return self._last


def _realign(state: CommState, bucket: dist.GradBucket, step: int) -> torch.futures.Future:
    """The first step after a checkpoint was restored: reduce the gradients in the checkpoint's buckets.

    DDP's first buckets differ from the ones it rebuilds after a step, which the checkpoint's state
    is laid out in. So the step's buckets are held until the last one comes; then each of the
    checkpoint's buckets is assembled from them, reduced as the uninterrupted job would have, and
    copied back. The step loses its overlap with the backward pass, and the trajectory is exact.
    """
    buffer = bucket.buffer()
    entry = (buffer, _signature(state, bucket), bucket.gradients(), bucket.parameters())
    if not bucket.is_last():
        fut: torch.futures.Future = torch.futures.Future(
            devices=[buffer.device] if buffer.device.type == "cuda" else []
        )
        state.realigning.append((fut, entry))
        return fut
    held, state.realigning = state.realigning, []

    def job() -> torch.Tensor:
        try:
            _reduce_in_restored_buckets(state, [e for _, e in held] + [entry], step)
        except BaseException as e:
            for fut, _ in held:
                fut.set_exception(e)
            raise
        for fut, (held_buffer, *_) in held:
            fut.set_result(held_buffer)
        return buffer

    return comm_thread().submit(job, buffer.device, state.groups)


def _reduce_in_restored_buckets(state: CommState, entries: list, step: int) -> None:
    gradients = {i: g for _, places, grads, _ in entries for i, g in zip(places, grads)}
    parameters = {i: p for _, places, _, params in entries for i, p in zip(places, params)}
    restored, state.restored_buckets = sorted(state.restored_buckets.items()), {}
    covered = sorted(i for _, signature in restored for i in signature)
    if covered != sorted(gradients) or len({gradients[i].dtype for i in covered}) > 1:
        # Not the parameters the checkpoint's buckets hold: this step is reduced as a first step is.
        warn_once(
            "the restored communication state does not match this model's buckets: the first step after "
            "the restart is reduced exactly, and the codec's state is used from the next one"
        )
        for buffer, *_ in entries:
            _exact(state, buffer)
        return
    for n, (index, signature) in enumerate(restored):
        grads = [gradients[i] for i in signature]
        sizes = [g.numel() for g in grads]
        flat = torch.cat([g.reshape(-1) for g in grads])
        follow_bucket(state, index, signature)
        views = [v.view_as(g) for v, g in zip(flat.split(sizes), grads)]
        assembled = _Bucket(index, flat, views, n == len(restored) - 1, [parameters[i] for i in signature])
        if state.powersgd is not None:
            result = _powersgd_bucket(state, assembled, step)
        else:
            state.last_step_compressed = True
            velocity = bucket_velocity(state.moved, assembled, flat) if state.moved is not None else None
            if state.hierarchy is not None:
                result = _hierarchical(state, flat, index, step, velocity)
            else:
                result = _flat(state, flat, index, step, velocity)
        for part, g in zip(result.split(sizes), grads):
            g.copy_(part.view_as(g))


def _signature(state: CommState, bucket: dist.GradBucket) -> Signature:
    """The places of the bucket's parameters in the model (parameters it was not told of get the next ones)."""
    index = state.param_index
    return tuple(index.setdefault(id(p), len(index)) for p in bucket.parameters())


def _drop_residuals_after_a_skipped_step(state: CommState) -> None:
    """If no optimizer stepped since the last step's exchange, that step's gradient was discarded by the script
    (a GradScaler or a loss-spike check): what its residuals kept of it must not reach later steps.

    Off until an optimizer has stepped on the model (one outside torch.optim would look like it never does),
    and without an observer (a state built by hand, or a model detached by `shutdown()`).
    """
    now = state.observer.optimizer_steps if state.observer is not None else None
    seen, state.optimizer_steps_at_last_step = state.optimizer_steps_at_last_step, now
    if not now or seen != now or state.reductions == state.reductions_at_start:
        return
    state.skipped_steps += 1
    stores = bucket_stores(state)
    for name in LOCAL_STORES:  # residuals, momentum and PowerSGD's error start again from zero
        stores.get(name, {}).clear()
    for entries in state.parked.values():
        for name in LOCAL_STORES:
            entries.pop(name, None)
    warn_once(
        "a step's gradients were reduced but no optimizer stepped on them (skipped by the script, or "
        "accumulated without no_sync()): the codec's residuals are dropped after such a step so that "
        "nothing of a discarded gradient reaches later steps"
    )


def _world(state: CommState) -> int:
    return dist.get_world_size(state.group)


def _exact(state: CommState, buffer: torch.Tensor) -> torch.Tensor:
    """Plain DDP's reduction: the mean of the buffer in its own dtype."""
    buffer.div_(_world(state))
    dist.all_reduce(buffer, group=state.group)
    state.flat_bytes_sent += buffer.numel() * buffer.element_size()
    return buffer


def _sparse_mean(state: CommState, buffer: torch.Tensor, by_gather: bool) -> torch.Tensor:
    """The mean of a sparse gradient over the workers, exactly and coalesced (it stays sparse, as under plain DDP).

    Gloo's sparse allreduce gathers every worker's indices and values and adds them up in rank order. Where the
    backend has none (NCCL, MPI), `by_gather` does the same with two all-gathers, as Horovod's sparse allreduce does
    (on the CPU, Gloo's sum bit for bit). The workers' numbers of rows differ, so one small all-gather of those comes
    first and the rows are padded to the largest; reading those numbers waits for them on the host (this thread).
    """
    warn_once(
        "sparse gradients (e.g. nn.Embedding(sparse=True)) are averaged exactly, uncompressed; "
        "the codec applies to the dense buckets"
    )
    world = _world(state)
    buffer = buffer.coalesce()  # one value per row: what Gloo's sparse allreduce expects
    buffer.div_(world)
    if not by_gather:
        dist.all_reduce(buffer, group=state.group)
        state.flat_bytes_sent += buffer._values().numel() * buffer.element_size()
        return buffer
    indices, values = buffer._indices(), buffer._values()
    rows = torch.tensor([indices.shape[1]], dtype=torch.int64, device=values.device)
    every = rows.new_empty(world)
    all_gather_single(every, rows, group=state.group)
    counts = every.tolist()
    most = max(counts)
    padded_indices = indices.new_zeros(indices.shape[0], most)
    padded_indices[:, : indices.shape[1]] = indices
    padded_values = values.new_zeros(most, *values.shape[1:])
    padded_values[: values.shape[0]] = values
    all_indices = indices.new_empty(world * padded_indices.numel())  # flat: Gloo gathers no stacked shapes
    all_values = values.new_empty(world * padded_values.numel())
    all_gather_single(all_indices, padded_indices.reshape(-1), group=state.group)
    all_gather_single(all_values, padded_values.reshape(-1), group=state.group)
    all_indices = all_indices.view(world, *padded_indices.shape)
    all_values = all_values.view(world, *padded_values.shape)
    state.flat_bytes_sent += (world - 1) * (
        padded_indices.numel() * padded_indices.element_size() + padded_values.numel() * padded_values.element_size()
    )
    gathered = torch.sparse_coo_tensor(
        torch.cat([all_indices[r, :, :n] for r, n in enumerate(counts)], dim=1),
        torch.cat([all_values[r, :n] for r, n in enumerate(counts)]),
        buffer.shape,
        check_invariants=False,  # the workers' own coalesced rows
    )
    return gathered.coalesce()  # the rows of all ranks, in rank order: duplicates summed as Gloo sums them


def _flat(
    state: CommState, buffer: torch.Tensor, index: int, step: int, velocity: torch.Tensor | None = None
) -> torch.Tensor:
    # With error feedback the buffer is folded into the residual, so the result may reuse it.
    out = buffer if state.feedback is not None else None
    scale = 1.0 / _world(state)
    outcome = start_exchange(
        state.codec, state.feedback, buffer, index, state.group, scale, out, velocity=velocity
    ).finish()
    state.flat_bytes_sent += outcome.sent
    if outcome.fallback is not None:
        _note_fallback(state, f"bucket {index}", step, outcome.fallback)
    return outcome.result


def _hierarchical(
    state: CommState, buffer: torch.Tensor, index: int, step: int, velocity: torch.Tensor | None = None
) -> torch.Tensor:
    # Dividing before the reduction keeps fp16 sums from overflowing.
    result, fallbacks = state.hierarchy.reduce(buffer.div_(_world(state)), index, velocity)
    for level, fallback in fallbacks:
        _note_fallback(state, f"bucket {index} ({level})", step, fallback)
    return result


def _powersgd_bucket(state: CommState, bucket: dist.GradBucket, step: int) -> torch.Tensor:
    original = bucket.buffer().clone()  # torch's hook changes the buffer in place: kept for an exact retry
    result, sent = powersgd_reduce(state.powersgd, bucket)  # divides by the world size itself
    state.flat_bytes_sent += sent
    if bool(all_finite(result)):
        return result
    forget_bucket(state.powersgd, bucket.index())
    exact = _exact(state, original)
    _note_fallback(state, f"bucket {bucket.index()}", step, EXACT if bool(exact.isfinite().all()) else NOT_FINITE)
    return exact


def _note_fallback(state: CommState, where: str, step: int, fallback: str) -> None:
    """Count an exact retry; say once per job what happened and what it means."""
    state.fallbacks += 1
    say_fallback("powersgd" if state.powersgd is not None else state.codec.name, where, fallback, step)


def _check_finite(state: CommState, bucket: dist.GradBucket, result: torch.Tensor) -> None:
    if bool(all_finite(result.coalesce().values() if result.is_sparse else result)):
        return
    bad, offset = [], 0
    if result.is_sparse:  # DDP gives a sparse gradient a bucket of its own
        bad = [state.param_names.get(id(p), f"<parameter of shape {tuple(p.shape)}>") for p in bucket.parameters()]
    for param, grad in zip(bucket.parameters(), bucket.gradients()) if not result.is_sparse else ():
        n = grad.numel()
        if not bool(torch.isfinite(result[offset : offset + n]).all()):
            bad.append(state.param_names.get(id(param), f"<parameter of shape {tuple(param.shape)}>"))
        offset += n
    where = ", ".join(bad)
    message = (
        f"non-finite gradient after allreduce at step {state.reductions} in: {where} (nan_check={state.nan_check})"
    )
    if state.nan_check == "raise":
        raise FloatingPointError(message)
    log.warning(message)
