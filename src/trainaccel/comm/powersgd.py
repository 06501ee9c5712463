"""`compression=powersgd`: torch's own PowerSGD hook (low-rank P, Q with error feedback), counted and checked."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

# Plain allreduce for at least the first START_STEP steps (torch refuses fewer with error feedback
# or warm start on); it also lets DDP rebuild its buckets before PowerSGD keeps per-bucket state.
START_STEP = 2


def powersgd_state(
    process_group: dist.ProcessGroup | None, rank: int, seed: int = 0, start: int = START_STEP
) -> PowerSGDState:
    """PowerSGD of `rank` with error feedback and warm start, compressing after `start` (at least 2) steps."""
    return PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=max(START_STEP, start),
        use_error_feedback=True,
        warm_start=True,
        random_seed=seed,
    )


def powersgd_reduce(state: PowerSGDState, bucket: dist.GradBucket) -> tuple[torch.Tensor, int]:
    """Run torch's PowerSGD hook on one bucket to completion; returns the result and the bytes sent.

    The hook waits for its second allreduce inside the first one's callback, on a c10d thread.
    With several buckets in flight on Gloo, those waits can take every thread and deadlock, so
    it runs one bucket at a time on the engine's communication thread (see `trainaccel_comm_hook`).
    """
    buffer = bucket.buffer()
    compressing = state.iter >= state.start_powerSGD_iter
    before = state.total_numel_after_compression
    result = powerSGD_hook(state, bucket).wait()
    numel = state.total_numel_after_compression - before if compressing else buffer.numel()
    return result, numel * buffer.element_size()


def forget_bucket(state: PowerSGDState, index: int) -> None:
    """Drop a bucket's error and warm-start factors (after a non-finite step they would poison every later one)."""
    for store in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
        store.pop(index, None)
