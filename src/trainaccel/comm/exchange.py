"""One codec-encoded sum over a process group: allreduce of summable payloads, else allgather and decode.

`start_exchange` issues the collective; `finish()` waits, and when a lossy payload's sum is not
finite (a value beyond the codec's range, or a non-finite gradient) it reduces the input again
exactly, on every rank alike, and clears the residual. Callers finish exchanges in one order on
every rank (the engine's communication thread, or the caller's own thread), so the retries match.
That decision reads the sum on the host (one read per exchange): codecs whose sum is finite exactly
when the exact one is (`keeps_finiteness`: bf16, int8, fp4) skip it, so on a GPU nothing waits.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from trainaccel.comm.codecs import Codec, ErrorFeedback
from trainaccel.context import log, warn_once
from trainaccel.monitor import timeline


# torch 2.13 renamed the tensor forms of these collectives; older releases have only the old names.
def all_gather_single(*args: Any, **kwargs: Any) -> Any:
    """torch's one-tensor all-gather, looked up at each call: the owners check's wrapper sees it too."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    """torch's one-tensor reduce-scatter, looked up at each call (as `all_gather_single`)."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


EXACT = "exact"  # Outcome.fallback: the lossy sum was not finite; the exact one is
NOT_FINITE = "not finite"  # ...and the exact sum is not finite either: the gradient itself is not


@dataclasses.dataclass
class Outcome:
    """A finished exchange: the sum, the bytes each rank received, and the fallback taken if any."""

    result: torch.Tensor
    sent: int
    fallback: str | None = None


def received_bytes(payload: torch.Tensor, summable: bool, size: int) -> int:
    """What one rank receives: the summed payload, or every other rank's payload when gathered."""
    nbytes = payload.numel() * payload.element_size()
    return nbytes if summable else nbytes * (size - 1)


class Pending:
    """An exchange whose collective is in flight; `finish()` completes it on the calling thread."""

    def __init__(
        self,
        codec: Codec,
        feedback: ErrorFeedback | None,
        tensor: torch.Tensor,
        key: Any,
        group: dist.ProcessGroup,
        scale: float,
        out: torch.Tensor | None,
        span_name: str | None,
        velocity: torch.Tensor | None = None,
        check: bool | None = None,
    ):
        self.codec, self.feedback, self.key, self.group, self.scale = codec, feedback, key, group, scale
        self.check = needs_check(codec, check)
        self.tensor, self.out = tensor, out
        self.trace = timeline.current()
        began = time.perf_counter() if self.trace is not None else 0.0
        if feedback is not None:
            corrected = feedback.correct(key, tensor, scale, velocity)  # one pass: scaled into the residual
            self.scaled = False  # `tensor` itself is left as it was, for an exact retry
        else:
            corrected = tensor.mul_(scale) if scale != 1.0 else tensor
            self.scaled = True
        self.size = dist.get_world_size(group)
        self.payload, self.ctx = encode(codec, corrected, key, group)
        self.mine = None  # this rank's payload decoded, where feedback already did it
        if feedback is not None:
            self.mine = feedback.update(key, corrected, codec, self.payload, self.ctx)
            adaptive = getattr(codec, "adaptive", None)
            if adaptive is not None:  # `corrected` now holds what waits: the residual
                adaptive.measure(key, corrected, tensor, scale, group)
        # The group's own rank: on_lost_replica's member groups are built from the store, unknown to get_rank().
        self.rank = group.rank() if group is not None else dist.get_rank()
        self.sent = received_bytes(self.payload, codec.summable, self.size)
        self.collective = span_name or ("allreduce" if codec.summable else "allgather")
        self.issued = time.perf_counter() if self.trace is not None else 0.0
        if self.trace is not None:
            self.trace.span("encode", began, self.issued, timeline.bucket_track(key), codec=type(codec).__name__)
        if codec.summable:
            self.parts = [self.payload]
            self.work = dist.all_reduce(self.payload, group=group, async_op=True)
        else:
            gathered = self.payload.new_empty(self.size * self.payload.numel())
            self.parts = list(gathered.chunk(self.size))
            self.work = all_gather_single(gathered, self.payload, group=group, async_op=True)

    def finish(self) -> Outcome:
        self.work.wait()
        arrived = time.perf_counter() if self.trace is not None else 0.0
        if self.trace is not None:
            self.trace.span(self.collective, self.issued, arrived, timeline.bucket_track(self.key), bytes=self.sent)
        # Every rank holds the same summed or gathered payloads, so every rank decides alike.
        if self.check and not finite(self.codec, self.parts):
            note_overflow(self.codec, self.key)
            return self._exact()
        decoded = {self.rank: self.mine} if self.mine is not None and not self.codec.summable else {}
        total = decode(self.codec, self.parts, self.ctx, self.out, decoded)
        if self.trace is not None:
            self.trace.span("decode", arrived, time.perf_counter(), timeline.bucket_track(self.key))
        return Outcome(total, self.sent)

    def _exact(self) -> Outcome:
        """Sum the input uncompressed, as plain DDP would; what the residual held is dropped."""
        if self.feedback is not None:
            self.feedback.clear(self.key)
        exact = self.tensor if self.scaled or self.scale == 1.0 else self.tensor.mul_(self.scale)
        dist.all_reduce(exact, group=self.group)
        fallback = EXACT if bool(exact.isfinite().all()) else NOT_FINITE
        return Outcome(exact, self.sent + exact.numel() * exact.element_size(), fallback)


def warn_if_gathering_costs_more(codec: Codec, world: int, what: str, option: str = "compression") -> None:
    """Say once when a gathered codec makes each worker receive more than a float32 allreduce would at `world`.

    A gathered payload grows with the workers (each receives every other's, and holds all of them): past a few
    workers int8 and fp4 receive more than the ring allreduce of the uncompressed float32 values they replace.
    """
    payload_bytes = getattr(codec, "payload_bytes", None)
    if codec.summable or payload_bytes is None or world < 2:
        return
    n = 1 << 20
    received = (world - 1) * payload_bytes(n) / n  # bytes per element
    dense = 2 * 4 * (world - 1) / world  # a ring allreduce of float32: reduce-scatter, then all-gather
    if received > dense:
        warn_once(
            f"{option}={codec.name} gathers every worker's payload: with {world} workers each receives "
            f"{received:.1f} bytes per {what} element, {received / dense:.1f}x a float32 allreduce's {dense:.1f}, and "
            f"holds {world * payload_bytes(n) / n / 4:.1f}x the float32 values in memory while decoding; a summable "
            "codec (bf16, fp16) does not grow with the workers"
        )


def say_fallback(name: str, where: str, fallback: str, step: int | None = None) -> None:
    """Say once per job that a lossy sum was redone exactly (`fallback`); later cases are logged at debug level."""
    at = f" at step {step}" if step is not None else ""
    log.debug("compression=%s: %s was not finite%s: reduced exactly (%s)", name, where, at, fallback)
    if fallback == EXACT:
        warn_once(
            f"compression={name}:{at} the compressed sum of {where} was not finite (a gradient beyond the "
            "codec's range): it was reduced exactly instead, as plain DDP would, and its residual cleared; "
            "later cases are logged at debug level"
        )
    else:
        warn_once(
            f"compression={name}:{at} the gradient of {where} is not finite on some worker: it is passed on "
            "as plain DDP would (a GradScaler skips such a step) and the residual is cleared; later cases are "
            "logged at debug level"
        )


def needs_check(codec: Codec, check: bool | None = None) -> bool:
    """Whether a sum through `codec` is read on the host to choose an exact retry: for a lossy codec, always when
    `check` is True, where the codec needs it when None (see `keeps_finiteness`)."""
    return codec.lossy and (check if check is not None else not getattr(codec, "keeps_finiteness", False))


def finite(codec: Codec, parts: list[torch.Tensor]) -> bool:
    """Whether every payload's values are finite: one read on the host, however many parts were gathered."""
    flags = [all_finite(_values(codec, part)) for part in parts]
    return bool(flags[0] if len(flags) == 1 else torch.stack(flags).all())


def all_finite(values: torch.Tensor) -> torch.Tensor:
    """`values.isfinite().all()`, on the device, without that full-size mask (on the CPU a large fresh one costs page
    faults, and the mask's pass is slow): the least and the greatest value are finite exactly when all are (a NaN
    anywhere makes both NaN)."""
    if values.is_complex():
        return values.isfinite().all()
    if not values.is_floating_point() or values.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=values.device)
    low, high = torch.aminmax(values)
    return low.isfinite() & high.isfinite()


def encode(codec: Codec, tensor: torch.Tensor, key: Any, group: dist.ProcessGroup) -> tuple[torch.Tensor, Any]:
    """`codec.compress(tensor, key)` for a sum or gather over `group`: a codec whose scale comes from the group's
    largest magnitude (fp16_scale=peak) gets it here, the same on every rank (a collective: call on every rank)."""
    if getattr(codec, "by_peak", False):
        scale = codec.peak_scale(group_peak(tensor, group), dist.get_world_size(group))
        return codec.compress(tensor, key, scale=scale)
    return codec.compress(tensor, key)


def group_peak(values: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The largest magnitude of `values` over `group`'s ranks: a one-element float32 tensor on their device, +inf when
    any value is not finite. One small allreduce, and no host read (on a GPU it is queued like the rest)."""
    low, high = torch.aminmax(values)  # no full-size |values| temporary
    peak = torch.maximum(high.float(), low.float().neg()).reshape(1)
    # A NaN becomes +inf before the maximum: backends need not carry a NaN through MAX.
    peak = torch.where(peak.isnan(), torch.full_like(peak, float("inf")), peak)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return peak


def note_overflow(codec: Codec, key: Any) -> None:
    """Tell a codec with a dynamic scale that a sum of `key`'s payloads was not finite."""
    overflowed = getattr(codec, "overflowed", None)
    if overflowed is not None:
        overflowed(key)


def _values(codec: Codec, payload: torch.Tensor) -> torch.Tensor:
    """The part of a payload that holds values (a sparse codec's indices are not checked)."""
    values = getattr(codec, "values", None)
    return payload if values is None else values(payload)


def start_exchange(
    codec: Codec,
    feedback: ErrorFeedback | None,
    tensor: torch.Tensor,
    key: Any,
    group: dist.ProcessGroup,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
    span_name: str | None = None,
    velocity: torch.Tensor | None = None,
    check: bool | None = None,
) -> Pending:
    """Start summing `scale * tensor` over `group` through `codec` (error feedback keyed by `key`).

    `velocity` starts the feedback's momentum for `key` if it has none. `tensor` is scaled in place
    only without feedback. A codec with `accumulate` or `decompress_into` decodes into
    `out` when given (a tensor of `tensor`'s shape whose values are no longer needed). With a
    timeline open, `key`'s track gets encode, `span_name` (default: the collective) and decode spans. `check`: read
    the sum's finiteness on the host for the exact retry always (True), or where the codec needs it (None).
    """
    return Pending(codec, feedback, tensor, key, group, scale, out, span_name, velocity, check)


def decode(
    codec: Codec,
    parts: list[torch.Tensor],
    ctx: Any,
    out: torch.Tensor | None = None,
    decoded: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The sum of decoded payloads, in the parts' order (into `out` when the codec can decode into it); `decoded`:
    parts already decoded, by index (used up: the sum may be made in one of them), the same bits as decoding them
    again. Sparse codecs add each part into a zeroed `out`; the others start from the first part's values."""
    decoded = decoded or {}
    into = getattr(codec, "decompress_into", None)
    accumulate = getattr(codec, "accumulate", None)
    if out is not None and into is None and accumulate is not None:
        out.zero_()
        for part in parts:
            accumulate(part, ctx, out)
        return out
    total = decoded.get(0)
    if total is None:
        total = into(parts[0], ctx, out) if out is not None and into is not None else codec.decompress(parts[0], ctx)
    for index in range(1, len(parts)):  # in order, on every rank: the same bits everywhere, NaNs' included
        known = decoded.get(index)
        if known is not None:
            total += known
        elif accumulate is not None and into is not None:  # a dense codec's, without a decoded temporary
            accumulate(parts[index], ctx, total)
        else:
            total += codec.decompress(parts[index], ctx)
    return total
