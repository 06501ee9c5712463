"""trainaccel's DDP communication hook: encode each bucket, allreduce it, decode, check it."""
# No `from __future__ import annotations`: DDP checks this hook's annotations at runtime.


import atexit
import dataclasses
import logging
import time
import weakref

import torch
import torch.distributed as dist

from trainaccel.comm.codecs import Codec

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


@dataclasses.dataclass
class CommState:
    """What the hook keeps between buckets and steps on one worker."""

    process_group: dist.ProcessGroup | None
    codec: Codec
    nan_check: str = "off"
    param_names: dict[int, str] = dataclasses.field(default_factory=dict)
    bytes_sent: int = 0
    steps: int = 0

    def bytes_per_step(self) -> float:
        """Average allreduce payload per step, in bytes (what this worker hands to the network)."""
        return self.bytes_sent / self.steps if self.steps else 0.0


def trainaccel_comm_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket across workers through `state.codec`."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    # Dividing before the reduction keeps fp16 sums from overflowing.
    payload, ctx = state.codec.compress(buffer.div_(dist.get_world_size(group)))
    state.bytes_sent += payload.numel() * payload.element_size()
    if bucket.is_last():
        state.steps += 1
    fut = dist.all_reduce(payload, group=group, async_op=True).get_future()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        result = state.codec.decompress(fut.value()[0], ctx)
        if state.nan_check != "off":
            _check_finite(state, bucket, result)
        return result

    return fut.then(_track(finish))


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
