"""Horovod's asynchronous collectives on torch.distributed, with Horovod's error semantics.

Each operation first exchanges descriptors (see `negotiation`), so mismatched calls raise on
every worker instead of hanging. Asynchronous forms return a handle for `poll` and
`synchronize`; a named one that meets a different operation elsewhere waits (parked) until
the others call it. A second operation under the name of one in flight raises `ValueError` on
the caller alone, before anything is exchanged. The synchronous, differentiable forms are in
`autograd`, the grouped forms in `grouped`.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainaccel.comm.exchange import all_gather_single
from trainaccel.devices import group_device
from trainaccel.horovod import background, negotiation
from trainaccel.horovod.basics import check_initialized
from trainaccel.horovod.exceptions import UnsupportedOperation
from trainaccel.horovod.process_sets import ProcessSet, resolve


class ReduceOp(enum.IntEnum):
    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.Average,
    ReduceOp.Sum,
    ReduceOp.Adasum,
    ReduceOp.Min,
    ReduceOp.Max,
    ReduceOp.Product,
)


class Handle:
    """An operation in flight; pass it to `poll` or `synchronize`."""

    def __init__(self, name: str, work: Any, finish: Callable[[], Any] | None):
        self.name, self._work, self._finish = name, work, finish
        self._parked: negotiation.Operation | None = None  # not started: the others have not called it yet
        self._set_id = 0
        self._started_at: int | None = None  # the process set's exchange count when the collective started

    def __repr__(self) -> str:
        return f"<trainaccel.horovod handle {self.name!r}>"

    def holds_name(self) -> bool:
        """Whether the name is still taken: the operation is parked, or no exchange of its set followed its start."""
        parts = getattr(self, "_parts", None)
        if parts is not None:
            return any(part.holds_name() for part in parts)
        # Horovod's background thread frees a name when it takes the operation up to run it (or to
        # report its error), a cycle after the call at the soonest, at a different moment on each
        # rank. The set's next exchange after the start stands for that cycle: it is the same point
        # on every member, so a name reused on every rank is accepted or refused on every rank.
        if self._parked is not None:
            return self._parked.error is None  # a parked operation that failed is over on every rank
        return self._started_at is None or negotiation.exchanges(self._set_id) <= self._started_at


_in_flight: dict[str, Handle] = {}  # explicitly named operations not yet synchronized
_auto_names = itertools.count()


def reset() -> None:
    """Forget operations in flight (at init and shutdown)."""
    _in_flight.clear()
    negotiation.reset()


def poll(handle: Handle) -> bool:
    """Whether the operation has finished (`synchronize` then returns without waiting)."""
    parts = getattr(handle, "_parts", None)
    if parts is not None:
        return all(poll(part) for part in parts)
    if handle._parked is not None:
        return False
    return handle._work is None or handle._work.is_completed()


def synchronize(handle: Handle) -> Any:
    """Wait for the operation and return its result."""
    try:
        if handle._parked is not None:
            negotiation.finish_parked(handle._parked)
        if handle._work is not None:
            handle._work.wait()
        return handle._finish()
    finally:
        if _in_flight.get(handle.name) is handle:
            del _in_flight[handle.name]


def _submit(
    kind: str,
    name: str | None,
    tensor: torch.Tensor,
    extra: int,
    ps: ProcessSet,
    launch: Callable[[torch.Tensor], tuple[Any, Callable[[], Any]]],
    *,
    first_dim_may_differ: bool = False,
) -> Handle:
    """Negotiate an operation and start it with `launch(descriptors)` -> (work, finish), now or once unparked."""
    handle = Handle(name or f"{kind}.noname.{next(_auto_names)}", None, None)
    op = negotiation.Operation(kind, name, tensor, extra, ps, first_dim_may_differ)
    handle._set_id = op.set_id

    def start(everyone: torch.Tensor) -> None:
        handle._work, handle._finish = launch(everyone)
        handle._parked = None
        handle._started_at = negotiation.exchanges(op.set_id)

    op.start = start
    # Only a named operation may wait for the others: unnamed ones are matched in call order.
    if not negotiation.submit(op, parkable=name is not None):
        handle._parked = op
    if name is not None:
        _in_flight[name] = handle
    return handle


def _claim(*names: str | None) -> None:
    """Raise `ValueError` if one of the names belongs to an operation in flight.

    Checked before any exchange, so that a rank calling a duplicate alone (as Horovod's tests do)
    raises alone; a name reused on every rank is judged alike everywhere (see `Handle.holds_name`).
    """
    background.drain()  # the exchange counts that names are judged by include the optimizer's exchanges so far
    for name in names:
        held = _in_flight.get(name) if name is not None else None
        if held is not None and held.holds_name():
            raise ValueError(
                f"an operation named {name!r} is already in flight; synchronize it first or choose another name"
            )


def _begin(name: str | None, process_set: ProcessSet | None) -> ProcessSet:
    check_initialized()
    ps = resolve(process_set)
    _claim(name)
    return ps


def resolve_op(average: bool | None, op: ReduceOp | None, default: ReduceOp = Average) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("pass either average= (deprecated) or op=, not both")
    if average is not None:
        return Average if average else Sum
    op = default if op is None else ReduceOp(op)
    if op == Adasum:
        raise UnsupportedOperation("op=Adasum is not supported; accepted: Average, Sum, Min, Max, Product")
    return op


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply in place as Horovod does: integers in float64, half precision in float32."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point() and tensor.element_size() >= 4:
        return tensor.mul_(factor)
    wide = torch.float64 if not tensor.is_floating_point() else torch.float32
    return tensor.copy_(tensor.to(wide).mul_(factor))


def _moved(tensor: torch.Tensor) -> torch.Tensor:
    """A view Gloo can move: it has no int16, whose bits travel unchanged as float16."""
    return tensor.view(torch.float16) if tensor.dtype == torch.int16 else tensor


def _summable(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor Gloo can reduce: int16 widened to int32 (the result is cast back)."""
    return tensor.to(torch.int32) if tensor.dtype == torch.int16 else tensor


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
    *,
    fused_buffers: int = 1,
) -> Handle:
    """Start reducing `tensor` in place across the workers of `process_set` (all by default)."""
    ps = _begin(name, process_set)
    op = resolve_op(average, op)
    world = ps.size() or 1

    def launch(everyone: torch.Tensor) -> tuple[Any, Callable[[], torch.Tensor]]:
        wire = _summable(scale_(tensor, prescale_factor))
        work = dist.all_reduce(wire, op=negotiation.TORCH_OPS[op.name], group=ps.group, async_op=True)

        def finish() -> torch.Tensor:
            if wire is not tensor:
                tensor.copy_(wire)
            if op == Average:
                if tensor.is_floating_point():
                    tensor.div_(world)
                else:
                    tensor.copy_(tensor.div(world, rounding_mode="trunc"))
            return scale_(tensor, postscale_factor)

        return work, finish

    return _submit("allreduce", name, tensor, negotiation.pack_op(int(op), fused_buffers), ps, launch)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Start reducing a copy of `tensor`; `synchronize` returns the result."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """Reduce `tensor` in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None) -> Handle:
    """Start concatenating every worker's `tensor` along the first dimension (sizes may differ)."""
    ps = _begin(name, process_set)
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor of at least one dimension")

    def launch(everyone: torch.Tensor) -> tuple[Any, Callable[[], torch.Tensor]]:
        firsts = [int(d) for d in everyone[:, 4]]
        longest = max(firsts)
        padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]] = tensor.detach()
        gathered = padded.new_empty((len(firsts) * longest, *tensor.shape[1:]))
        work = all_gather_single(_moved(gathered), _moved(padded), group=ps.group, async_op=True)

        def finish() -> torch.Tensor:
            parts = gathered.split(longest) if longest else [gathered] * len(firsts)
            return torch.cat([part[:n] for part, n in zip(parts, firsts)])

        return work, finish

    return _submit("allgather", name, tensor, 0, ps, launch, first_dim_may_differ=True)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet | None = None
) -> Handle:
    """Start overwriting `tensor` in place with the root's (`root_rank` is a global rank)."""
    ps = _begin(name, process_set)
    if root_rank not in ps.ranks:
        raise ValueError(f"invalid root_rank={root_rank}; accepted: a rank of the process set, {ps.ranks}")

    def launch(everyone: torch.Tensor) -> tuple[Any, Callable[[], torch.Tensor]]:
        return dist.broadcast(_moved(tensor), src=root_rank, group=ps.group, async_op=True), lambda: tensor

    return _submit("broadcast", name, tensor, root_rank, ps, launch)


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet | None = None
) -> Handle:
    """Start broadcasting into a copy of `tensor`; `synchronize` returns it."""
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet | None = None
) -> torch.Tensor:
    """Overwrite `tensor` in place with the root's and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(
    tensor: torch.Tensor,
    splits: torch.Tensor | list[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Start sending `splits[j]` rows of `tensor` to worker j; `synchronize` returns (output, received_splits)."""
    ps = _begin(name, process_set)
    world = ps.size() or 1
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension")
    if splits is None:
        if tensor.shape[0] % world:
            raise ValueError(
                f"alltoall without splits needs the first dimension ({tensor.shape[0]}) "
                f"divisible by the set's size ({world})"
            )
        send = [tensor.shape[0] // world] * world
    else:
        if torch.is_tensor(splits) and (splits.is_floating_point() or splits.dim() != 1):
            raise ValueError(
                f"invalid splits of dtype {splits.dtype} and shape {tuple(splits.shape)}; "
                "accepted: a 1-D integer tensor or list"
            )
        send = [int(x) for x in (splits.tolist() if torch.is_tensor(splits) else splits)]
        if len(send) != world or any(x < 0 for x in send) or sum(send) != tensor.shape[0]:
            raise ValueError(
                f"invalid splits={send}; accepted: {world} non-negative counts "
                f"that add up to the first dimension ({tensor.shape[0]})"
            )

    def launch(everyone: torch.Tensor) -> tuple[Any, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
        device = group_device(ps.group)  # the splits travel on the group's device (an NCCL-only group's GPU)
        received = torch.empty(world, dtype=torch.int64, device=device)
        dist.all_to_all_single(received, torch.tensor(send, dtype=torch.int64, device=device), group=ps.group)
        counts = received.tolist()
        output = tensor.new_empty((sum(counts), *tensor.shape[1:]))
        work = dist.all_to_all_single(
            _moved(output), _moved(tensor.detach().contiguous()), counts, send, group=ps.group, async_op=True
        )
        return work, lambda: (output, received.to(torch.int32))

    return _submit("alltoall", name, tensor, 0, ps, launch, first_dim_may_differ=True)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp | None = None,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start reducing `tensor` across workers; this worker keeps its share of the first dimension."""
    ps = _begin(name, process_set)
    op = resolve_op(None, op)
    if op not in (Average, Sum):
        raise UnsupportedOperation(f"reducescatter supports op=Average or Sum, got {op.name}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    world, rank = ps.size() or 1, ps.rank() or 0
    rows = share_rows(tensor.shape[0], world)
    start = sum(rows[:rank])
    source = tensor.detach().clone()  # an asynchronous call may start later: keep the input as it is now

    def launch(everyone: torch.Tensor) -> tuple[Any, Callable[[], torch.Tensor]]:
        # Gloo's reduce-scatter is slower than its allreduce, and needs equal shares: reduce all, keep ours.
        full = _summable(scale_(source, prescale_factor))
        work = dist.all_reduce(full, group=ps.group, async_op=True)

        def finish() -> torch.Tensor:
            mine = full.narrow(0, start, rows[rank]).to(tensor.dtype, copy=True)
            if op == Average:
                mine = mine / world if mine.is_floating_point() else mine.div(world, rounding_mode="trunc")
            return scale_(mine, postscale_factor)

        return work, finish

    return _submit("reducescatter", name, tensor, int(op), ps, launch)


def share_rows(rows: int, world: int) -> list[int]:
    """Rows each worker keeps in reducescatter: as even as possible, lower ranks first."""
    return [rows // world + (1 if r < rows % world else 0) for r in range(world)]


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None = None, op: ReduceOp | None = None, process_set: ProcessSet | None = None
) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor by gathering indices and values; call the result to wait."""
    op = resolve_op(None, op)
    if op not in (Average, Sum):
        raise ValueError(f"sparse allreduce supports op=Average or Sum, got {op.name}")
    t = tensor.coalesce()
    if name is not None:
        _claim(f"{name}.indices", f"{name}.values")  # both, or neither starts
    # Unnamed, its two gathers stay unnamed too: matched in call order, never parked.
    indices = allgather_async(t.indices().t().contiguous(), None if name is None else f"{name}.indices", process_set)
    values = allgather_async(t.values(), None if name is None else f"{name}.values", process_set)
    size = resolve(process_set).size() or 1

    def wait() -> torch.Tensor:
        gathered_values, gathered_indices = synchronize(values), synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / size
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, t.shape, check_invariants=False)

    return wait


def barrier(process_set: ProcessSet | None = None) -> None:
    """Wait until every worker of the set gets here."""
    ps = _begin(None, process_set)
    negotiation.negotiate("barrier", None, torch.zeros(1), among=ps)  # the exchange is the barrier


def join(device: int = -1) -> int:
    """This worker has no more data: take part in the others' allreduces until all join; returns the last to join.

    `device` is the CUDA device of the tensors the others reduce (-1: CPU), as in Horovod.
    """
    check_initialized()
    if isinstance(device, bool) or not isinstance(device, int) or device < -1:
        raise ValueError(f"invalid device={device!r}; accepted: -1 (CPU) or a CUDA device index")
    return negotiation.join(torch.device("cpu") if device < 0 else torch.device("cuda", device))


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet | None = None
) -> Any:
    """The root's `obj` on every worker (pickled, as in Horovod)."""
    ps = _begin(name, process_set)
    if root_rank not in ps.ranks:
        raise ValueError(f"invalid root_rank={root_rank}; accepted: a rank of the process set, {ps.ranks}")
    negotiation.negotiate("object", name, torch.zeros(1), root_rank, among=ps)
    holder = [obj if dist.get_rank() == root_rank else None]
    dist.broadcast_object_list(holder, src=root_rank, group=ps.group)
    return holder[0]


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet | None = None) -> list[Any]:
    """Every worker's `obj`, in rank order."""
    ps = _begin(name, process_set)
    negotiation.negotiate("object", name, torch.zeros(1), -1, among=ps)
    out: list[Any] = [None] * (ps.size() or 1)
    dist.all_gather_object(out, obj, group=ps.group)
    return out
