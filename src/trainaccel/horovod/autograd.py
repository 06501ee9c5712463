"""The synchronous collectives, differentiable as in Horovod.

Gradients follow Horovod's convention: each worker's loss is treated as one replica of the
same objective, so allgather and broadcast average the incoming gradients, allreduce reduces
them with the forward op, alltoall sends them back, and reducescatter gathers them.
"""

from __future__ import annotations

from typing import Any

import torch

from trainaccel.horovod import ops
from trainaccel.horovod.compression import Compression, Compressor
from trainaccel.horovod.ops import Average, ReduceOp, Sum, synchronize
from trainaccel.horovod.process_sets import ProcessSet, resolve


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        pre: float,
        post: float,
        process_set: ProcessSet | None,
    ) -> torch.Tensor:
        ctx.args = (op, pre, post, process_set)
        return synchronize(ops.allreduce_async(tensor, None, name, op, pre, post, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, pre, post, process_set = ctx.args
        return allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post, process_set=process_set), *[None] * 5


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] | Compressor = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """The reduction of `tensor` over the workers (Average by default), as a new, differentiable tensor."""
    op = ops.resolve_op(average, op)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet | None) -> torch.Tensor:
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(ops.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = allreduce(grad, op=Average, process_set=ctx.process_set)
        rows = ops.allgather_async(torch.tensor([ctx.rows]), None, ctx.process_set)
        offset = int(synchronize(rows)[: resolve(ctx.process_set).rank()].sum())
        return averaged.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None) -> torch.Tensor:
    """Every worker's `tensor` concatenated along the first dimension, in rank order (differentiable)."""
    return _Allgather.apply(tensor, name, process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet | None
    ) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = allreduce(grad, op=Average, process_set=ctx.process_set)
        if torch.distributed.get_rank() != ctx.root_rank:
            averaged = torch.zeros_like(averaged)  # only the root's input reached the output
        return averaged, None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet | None = None
) -> torch.Tensor:
    """The root's `tensor` on every worker, as a new, differentiable tensor."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = synchronize(ops.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple:
        returned, _sent = synchronize(ops.alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set))
        return returned, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: torch.Tensor | list[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> Any:
    """Rows of every worker's `tensor` addressed to this one, in rank order; with `splits`, also the counts received."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        process_set: ProcessSet | None,
        pre: float,
        post: float,
    ) -> torch.Tensor:
        ctx.args = (op, process_set, pre * post)
        return synchronize(ops.reducescatter_async(tensor, name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, process_set, factor = ctx.args
        if op == Sum:
            factor *= resolve(process_set).size() or 1
        return allgather(grad * factor if factor != 1.0 else grad, process_set=process_set), *[None] * 5


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] | Compressor = Compression.none,
    op: ReduceOp | None = Average,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This worker's share (rows split as evenly as possible, lower ranks first) of the reduction (differentiable)."""
    op = ops.resolve_op(None, op)
    compressed, ctx = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)
