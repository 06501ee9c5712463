"""Horovod's grouped collectives: one call over a list of tensors, one handle for all of them.

Tensors in the same list position must match across workers. The grouped allreduce fuses
tensors of one dtype into a single buffer (one negotiation, one collective), as Horovod's
fusion buffer does; allgather and reducescatter run one collective per tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from trainaccel.horovod import ops
from trainaccel.horovod.compression import Compression, Compressor
from trainaccel.horovod.ops import Average, Handle, ReduceOp, Sum, synchronize
from trainaccel.horovod.process_sets import ProcessSet, resolve


def _group(kind: str, name: str | None, handles: list[Handle], finish: Any = None) -> Handle:
    """One handle over several: done when all are, its result the list of theirs."""
    results = finish or (lambda: [synchronize(h) for h in handles])
    group = Handle(name or f"{kind}.noname.{next(ops._auto_names)}", None, results)
    group._parts = handles  # type: ignore[attr-defined]
    if name is not None:
        ops._in_flight[name] = group
    return group


def _named(name: str | None, suffix: object) -> str | None:
    return None if name is None else f"{name}.{suffix}"


def grouped_allreduce_async_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Start reducing each tensor of a list in place; `synchronize` returns the list."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    # Every name is checked before the first buffer starts: a group starts whole or not at all.
    ops._claim(name, *[_named(name, dtype) for dtype in by_dtype])
    fused = []
    for k, (dtype, positions) in enumerate(sorted(by_dtype.items(), key=lambda item: str(item[0]))):
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in positions])
        # The first buffer's descriptor carries how many follow, so workers that would issue
        # different numbers of collectives raise together instead of hanging.
        handle = ops.allreduce_async_(
            flat,
            average,
            _named(name, dtype),
            op,
            prescale_factor,
            postscale_factor,
            process_set,
            fused_buffers=len(by_dtype) if k == 0 else 1,
        )
        fused.append((positions, flat, handle))

    def finish() -> list[torch.Tensor]:
        for positions, flat, handle in fused:
            synchronize(handle)
            offset = 0
            for i in positions:
                n = tensors[i].numel()
                tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
                offset += n
        return tensors

    return _group("grouped_allreduce", name, [h for _, _, h in fused], finish)


def grouped_allreduce_async(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Start reducing copies of the tensors; `synchronize` returns the results."""
    copies = [t.detach().clone() for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    """Reduce each tensor in place and return the list."""
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        pre: float,
        post: float,
        process_set: ProcessSet | None,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, pre, post, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, pre, post, process_set = ctx.args
        return (
            None,
            None,
            None,
            None,
            None,
            *grouped_allreduce(list(grads), None, None, Compression.none, op, pre, post, process_set),
        )


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] | Compressor = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    """The reduction of each tensor of a list, as new, differentiable tensors."""
    op = ops.resolve_op(average, op)
    packed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set, *[p for p, _ in packed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed)]


def grouped_allgather_async(
    tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None
) -> Handle:
    """Start gathering each tensor of a list; `synchronize` returns the list of results."""
    ops._claim(name, *[_named(name, i) for i in range(len(tensors))])
    return _group(
        "grouped_allgather", name, [ops.allgather_async(t, _named(name, i), process_set) for i, t in enumerate(tensors)]
    )


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: str | None, process_set: ProcessSet | None, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        averaged = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        rows = synchronize(ops.allgather_async(torch.tensor([ctx.rows]), None, ctx.process_set))
        before = rows[: resolve(ctx.process_set).rank()].sum(0)
        return None, None, *[g.narrow(0, int(o), n) for g, o, n in zip(averaged, before, ctx.rows)]


def grouped_allgather(
    tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None
) -> list[torch.Tensor]:
    """Each tensor of a list gathered from every worker (differentiable)."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


def grouped_reducescatter_async(
    tensors: list[torch.Tensor],
    name: str | None = None,
    op: ReduceOp | None = Average,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start reduce-scattering each tensor of a list; `synchronize` returns this worker's shares."""
    ops._claim(name, *[_named(name, i) for i in range(len(tensors))])
    handles = [
        ops.reducescatter_async(t, _named(name, i), op, process_set, prescale_factor, postscale_factor)
        for i, t in enumerate(tensors)
    ]
    return _group("grouped_reducescatter", name, handles)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        process_set: ProcessSet | None,
        pre: float,
        post: float,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, process_set, pre * post)
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, process_set, factor = ctx.args
        if op == Sum:
            factor *= resolve(process_set).size() or 1
        return None, None, None, None, None, *grouped_allgather([g * factor for g in grads], process_set=process_set)


def grouped_reducescatter(
    tensors: list[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] | Compressor = Compression.none,
    op: ReduceOp | None = Average,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """This worker's share of the reduction of each tensor of a list (differentiable)."""
    op = ops.resolve_op(None, op)
    packed = [compression.compress(t) for t in tensors]
    reduced = _GroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *[p for p, _ in packed]
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed)]
