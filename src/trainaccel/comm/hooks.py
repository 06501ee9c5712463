"""trainaccel's DDP communication hook: encode each bucket, reduce it (flat or hierarchical), decode, check it."""
# No `from __future__ import annotations`: DDP checks this hook's annotations at runtime.


import dataclasses
import logging
import time

import torch
import torch.distributed as dist

from trainaccel.comm.codecs import Codec, ErrorFeedback
from trainaccel.comm.exchange import exchange
from trainaccel.comm.exit_guard import track
from trainaccel.comm.hierarchical import HierarchicalReduce, StagedPipeline
from trainaccel.comm.powersgd import PowerSGDState, powersgd_reduce
from trainaccel.monitor import timeline

log = logging.getLogger("trainaccel")


@dataclasses.dataclass
class CommWait:
    """This worker's wait for its peers in one step: from its last bucket ready to its reductions done."""

    ready: float | None = None  # when the step's last bucket reached the hook: local work done
    done: float | None = None  # when the latest of the step's reductions completed

    def take(self) -> float:
        """The last step's wait in seconds (0 if none was seen), and forget it."""
        wait = self.done - self.ready if self.ready is not None and self.done is not None else 0.0
        self.ready = self.done = None
        return max(0.0, wait)

    def mark_done(self, fut: torch.futures.Future) -> torch.Tensor:
        self.done = time.perf_counter()
        return fut.value()


@dataclasses.dataclass
class CommState:
    """What the hook keeps between buckets and steps on one worker.

    One of three reductions: torch's PowerSGD (`powersgd`), the two-level `hierarchy`, or one
    flat exchange of `codec` payloads over `process_group`.
    """

    process_group: dist.ProcessGroup | None
    codec: Codec
    nan_check: str = "off"
    param_names: dict[int, str] = dataclasses.field(default_factory=dict)
    feedback: ErrorFeedback | None = None
    hierarchy: HierarchicalReduce | None = None
    powersgd: PowerSGDState | None = None
    pipeline: StagedPipeline = dataclasses.field(default_factory=lambda: StagedPipeline(1))  # runs powersgd
    flat_bytes_sent: int = 0
    steps: int = 0
    # Set by `register` when there is nothing to add to a plain allreduce (no codec, no hierarchy,
    # no check): DDP's own C++ allreduce runs instead of this hook, with no Python per bucket.
    builtin: bool = False
    dense_bytes_per_step: int = 0  # what that allreduce sends per step
    comm_wait: CommWait | None = None  # measured for straggler detection

    @property
    def hierarchical(self) -> bool:
        return self.hierarchy is not None

    @property
    def bytes_sent(self) -> int:
        """Payload bytes handed to collectives that cross nodes (all of them when flat)."""
        return self.flat_bytes_sent + (self.hierarchy.bytes_sent if self.hierarchy is not None else 0)

    def bytes_per_step(self) -> float:
        """Average of `bytes_sent` per step (for DDP's own allreduce: the gradient's bytes)."""
        if self.builtin:
            return float(self.dense_bytes_per_step)
        return self.bytes_sent / self.steps if self.steps else 0.0


def trainaccel_comm_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket across workers through `state.codec` (hierarchically when set up)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    if bucket.is_last():
        state.steps += 1
        if state.comm_wait is not None:
            state.comm_wait.ready = time.perf_counter()
    if state.powersgd is not None:
        stage = timeline.traced("powersgd", bucket.index(), lambda b: _powersgd_bucket(state, b))
        fut = state.pipeline.submit([stage], bucket)
    else:
        # Dividing before the reduction keeps fp16 sums from overflowing.
        buffer, world = bucket.buffer(), dist.get_world_size(group)
        if state.hierarchy is not None:
            fut = state.hierarchy.submit(buffer.div_(world), bucket.index())
        else:
            # With error feedback the buffer is folded into the residual, so the result may reuse it.
            out = buffer if state.feedback is not None else None
            fut, sent = exchange(state.codec, state.feedback, buffer, bucket.index(), group, 1.0 / world, out)
            state.flat_bytes_sent += sent
    if state.comm_wait is not None:
        fut = fut.then(track(state.comm_wait.mark_done))
    if state.nan_check == "off":
        return fut

    def check(fut: torch.futures.Future) -> torch.Tensor:
        result = fut.value()
        _check_finite(state, bucket, result)
        return result

    return fut.then(track(check))


def _powersgd_bucket(state: CommState, bucket: dist.GradBucket) -> torch.Tensor:
    result, sent = powersgd_reduce(state.powersgd, bucket)  # divides by the world size itself
    state.flat_bytes_sent += sent
    return result


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
