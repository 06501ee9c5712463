"""One codec-encoded sum over a process group: allreduce of summable payloads, else allgather and decode."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from trainaccel.comm.codecs import Codec, ErrorFeedback
from trainaccel.comm.exit_guard import track
from trainaccel.monitor import timeline

# torch 2.13 renamed the tensor forms of these collectives; older releases have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def exchange(
    codec: Codec,
    feedback: ErrorFeedback | None,
    tensor: torch.Tensor,
    key: object,
    group: dist.ProcessGroup,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
    span_name: str | None = None,
) -> tuple[torch.futures.Future[torch.Tensor], int]:
    """Start summing `scale * tensor` over `group` through `codec`; returns the future and the payload bytes.

    `tensor` may be scaled in place. A codec with `accumulate` decodes into `out` when given
    (a tensor of `tensor`'s shape whose values are no longer needed) instead of a new tensor.
    With a timeline open, `key`'s track gets encode, `span_name` (default: the collective) and decode spans.
    """
    trace = timeline.current()
    began = time.perf_counter() if trace is not None else 0.0
    if feedback is not None:
        tensor = feedback.correct(key, tensor, scale)  # one pass: scaled into the residual
    elif scale != 1.0:
        tensor = tensor.mul_(scale)
    payload, ctx = codec.compress(tensor)
    if feedback is not None:
        feedback.update(key, tensor, codec, payload, ctx)
    sent = payload.numel() * payload.element_size()
    accumulate = getattr(codec, "accumulate", None) if out is not None else None
    collective = span_name or ("allreduce" if codec.summable else "allgather")
    if trace is not None:
        issued = time.perf_counter()
        trace.span("encode", began, issued, timeline.bucket_track(key), codec=type(codec).__name__)

    def decode(parts: list[torch.Tensor]) -> torch.Tensor:
        if trace is not None:
            arrived = time.perf_counter()
            trace.span(collective, issued, arrived, timeline.bucket_track(key), bytes=sent)
        if accumulate is not None:
            out.zero_()
            for part in parts:
                accumulate(part, ctx, out)
            total = out
        else:
            total = codec.decompress(parts[0], ctx)
            for part in parts[1:]:
                total += codec.decompress(part, ctx)
        if trace is not None:
            trace.span("decode", arrived, time.perf_counter(), timeline.bucket_track(key))
        return total

    if codec.summable:
        fut = dist.all_reduce(payload, group=group, async_op=True).get_future()
        return fut.then(track(lambda fut: decode([fut.value()[0]]))), sent
    size = dist.get_world_size(group)
    gathered = payload.new_empty(size * payload.numel())
    fut = all_gather_single(gathered, payload, group=group, async_op=True).get_future()
    return fut.then(track(lambda fut: decode(list(gathered.chunk(size))))), sent
