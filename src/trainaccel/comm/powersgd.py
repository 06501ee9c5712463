"""`compression=powersgd`: torch's own PowerSGD hook (low-rank P, Q with error feedback), counted and checked."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from trainaccel.comm import owners
from trainaccel.context import patch

# Plain allreduce for at least the first START_STEP steps (torch refuses fewer with error feedback
# or warm start on); it also lets DDP rebuild its buckets before PowerSGD keeps per-bucket state.
START_STEP = 2


def powersgd_state(
    process_group: dist.ProcessGroup | None, rank: int, seed: int = 0, start: int = START_STEP
) -> PowerSGDState:
    """PowerSGD of `rank` with error feedback and warm start, compressing after `start` (at least 2) steps."""
    if torch.cuda.is_available():
        _synchronize_cuda_devices_only()
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
    with owners.lent():  # its callbacks issue the next allreduces (on Gloo's thread) while this one waits
        result = powerSGD_hook(state, bucket).wait()
    numel = state.total_numel_after_compression - before if compressing else buffer.numel()
    return result, numel * buffer.element_size()


def _synchronize_cuda_devices_only() -> None:
    """Make `torch.cuda.synchronize` pass over a CPU device, until `shutdown()`.

    torch's PowerSGD hook synchronizes the bucket's device whenever CUDA is available, which fails for a model on the
    CPU of a machine with a GPU ("Expected a cuda device, but got: cpu"); a CPU tensor has no CUDA work to wait for.
    """
    synchronize = torch.cuda.synchronize
    if getattr(synchronize, "passes_over_cpu", False):
        return

    def synchronize_cuda_only(device=None) -> None:
        if isinstance(device, torch.device) and device.type != "cuda":
            return None
        return synchronize(device)

    synchronize_cuda_only.passes_over_cpu = True
    patch(torch.cuda, "synchronize", synchronize_cuda_only)


def forget_bucket(state: PowerSGDState, index: int) -> None:
    """Drop a bucket's error and warm-start factors (after a non-finite step they would poison every later one)."""
    for store in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
        store.pop(index, None)
