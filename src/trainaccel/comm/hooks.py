"""trainaccel's DDP communication hook: encode each bucket, reduce it (flat or hierarchical), decode, check it."""
# No `from __future__ import annotations`: DDP checks this hook's annotations at runtime.


import atexit
import dataclasses
import functools
import logging
import queue
import threading
import time
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from trainaccel.comm.codecs import Codec, ErrorFeedback, NoCompression
from trainaccel.comm.powersgd import PowerSGDState, powersgd_reduce
from trainaccel.comm.topology import Topology

log = logging.getLogger("trainaccel")

# Callbacks handed to c10d futures that a communication thread has not released yet.
# Gloo's thread drops them after running them, and that takes the GIL: if it happens
# once the interpreter is finalizing, the thread is killed and the process aborts
# ("terminate called without an active exception"). At exit we wait until they are gone.
_unreleased_callbacks: set[weakref.ref] = set()
_EXIT_GRACE_S = 0.02
_guard_exit = False


def guard_exit() -> None:
    """Make this process wait at exit for communication threads to release Python callbacks."""
    global _guard_exit
    _guard_exit = True


def _track(callback):
    guard_exit()
    _unreleased_callbacks.add(weakref.ref(callback, _unreleased_callbacks.discard))
    return callback


@atexit.register
def _wait_for_callback_release(timeout_s: float = 5.0) -> None:
    if not _guard_exit:
        return
    deadline = time.monotonic() + timeout_s
    while _unreleased_callbacks and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL, which is what the communication thread waits for
    # Callbacks of hooks we did not build (a script's own Python hook) are not tracked:
    # a short yield of the GIL lets a thread already waiting for it finish its release.
    time.sleep(_EXIT_GRACE_S)


class Pipeline:
    """One thread that runs multi-collective reductions in submission order.

    Every rank must issue the collectives of each group in the same order; running them from
    one thread, bucket after bucket, guarantees that without blocking c10d's own threads.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, work: Callable[[], torch.Tensor]) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainaccel-comm", daemon=True)
            self._thread.start()
        self._queue.put((work, fut))
        return fut

    def _run(self) -> None:
        while True:
            work, fut = self._queue.get()
            try:
                result = work()
            except BaseException as e:  # surfaces in DDP's backward on this rank
                fut.set_exception(e)
            else:
                fut.set_result(result)
            del work, fut


@dataclasses.dataclass
class CommState:
    """What the hook keeps between buckets and steps on one worker.

    With a `topology` that has intra- and inter-node groups the reduction is hierarchical
    (run in order on `pipeline`'s thread); otherwise it is one flat collective over `process_group`.
    """

    process_group: dist.ProcessGroup | None
    codec: Codec
    nan_check: str = "off"
    param_names: dict[int, str] = dataclasses.field(default_factory=dict)
    feedback: ErrorFeedback | None = None
    topology: Topology | None = None
    intra_codec: Codec = dataclasses.field(default_factory=NoCompression)
    intra_feedback: ErrorFeedback | None = None
    pipeline: Pipeline | None = None
    powersgd: PowerSGDState | None = None  # set: torch's PowerSGD hook replaces `codec`, always flat
    bytes_sent: int = 0  # handed to collectives that cross nodes (all of them when flat)
    intra_bytes_sent: int = 0  # handed to intra-node collectives
    steps: int = 0

    @property
    def hierarchical(self) -> bool:
        return self.topology is not None and self.topology.inter_group is not None

    def bytes_per_step(self) -> float:
        """Average payload per step this worker hands to cross-node (or flat) collectives, in bytes."""
        return self.bytes_sent / self.steps if self.steps else 0.0


def trainaccel_comm_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket across workers through `state.codec` (hierarchically when set up)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    if bucket.is_last():
        state.steps += 1
    if state.powersgd is not None:
        fut, sent = powersgd_reduce(state.powersgd, bucket)  # divides by the world size itself
        state.bytes_sent += sent
    else:
        # Dividing before the reduction keeps fp16 sums from overflowing.
        buffer = bucket.buffer().div_(dist.get_world_size(group))
        if state.hierarchical:
            assert state.pipeline is not None
            fut = state.pipeline.submit(functools.partial(_hierarchical, state, buffer, bucket.index()))
        else:
            fut = _exchange(state, state.codec, state.feedback, buffer, bucket.index(), group)
    if state.nan_check == "off":
        return fut

    def check(fut: torch.futures.Future) -> torch.Tensor:
        result = fut.value()
        _check_finite(state, bucket, result)
        return result

    return fut.then(_track(check))


def _exchange(
    state: CommState,
    codec: Codec,
    feedback: ErrorFeedback | None,
    tensor: torch.Tensor,
    key: object,
    group: dist.ProcessGroup,
    counter: str = "bytes_sent",
) -> torch.futures.Future[torch.Tensor]:
    """Sum `tensor` over `group` through `codec`, with error feedback when given."""
    if feedback is not None:
        tensor = feedback.correct(key, tensor)
    payload, ctx = codec.compress(tensor)
    if feedback is not None:
        feedback.update(key, tensor, codec.decompress(payload, ctx))
    setattr(state, counter, getattr(state, counter) + payload.numel() * payload.element_size())
    if codec.summable:
        fut = dist.all_reduce(payload, group=group, async_op=True).get_future()
        return fut.then(_track(lambda fut: codec.decompress(fut.value()[0], ctx)))
    size = dist.get_world_size(group)
    gathered = payload.new_empty(size * payload.numel())
    fut = dist.all_gather_into_tensor(gathered, payload, group=group, async_op=True).get_future()

    def decode_sum(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()
        parts = gathered.chunk(size)
        total = codec.decompress(parts[0], ctx)
        for part in parts[1:]:
            total += codec.decompress(part, ctx)
        return total

    return fut.then(_track(decode_sum))


def _hierarchical(state: CommState, buffer: torch.Tensor, key: int) -> torch.Tensor:
    """Reduce-scatter in the node, sum each shard across nodes, all-gather in the node."""
    topology = state.topology
    assert topology is not None and topology.intra_group is not None and topology.inter_group is not None
    local_size, n = topology.local_size, buffer.numel()
    shard_size = -(-n // local_size)
    padded = torch.nn.functional.pad(buffer, (0, shard_size * local_size - n)) if n % local_size else buffer

    intra = state.intra_codec
    full = padded
    if state.intra_feedback is not None:
        full = state.intra_feedback.correct(("intra", key), padded)
    payload, ctx = intra.compress(full)
    if state.intra_feedback is not None:
        state.intra_feedback.update(("intra", key), full, intra.decompress(payload, ctx))
    state.intra_bytes_sent += payload.numel() * payload.element_size()
    shard_payload = payload.new_empty(shard_size)
    dist.reduce_scatter_tensor(shard_payload, payload, group=topology.intra_group)
    shard = intra.decompress(shard_payload, ctx)

    shard = _exchange(state, state.codec, state.feedback, shard, key, topology.inter_group).wait()

    payload, ctx = intra.compress(shard)
    gathered = payload.new_empty(shard_size * local_size)
    dist.all_gather_into_tensor(gathered, payload, group=topology.intra_group)
    result = intra.decompress(gathered, ctx)[:n]
    return buffer.copy_(result) if result.data_ptr() != buffer.data_ptr() else buffer


def _check_finite(state: CommState, bucket: dist.GradBucket, result: torch.Tensor) -> None:
    if bool(torch.isfinite(result).all()):
        return
    bad, offset = [], 0
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        n = grad.numel()
        if not bool(torch.isfinite(result[offset : offset + n]).all()):
            bad.append(state.param_names.get(id(param), f"<parameter of shape {tuple(param.shape)}>"))
        offset += n
    message = (
        f"non-finite gradient after allreduce at step {state.steps} in: {', '.join(bad)} "
        f"(nan_check={state.nan_check})"
    )
    if state.nan_check == "raise":
        raise FloatingPointError(message)
    log.warning(message)
