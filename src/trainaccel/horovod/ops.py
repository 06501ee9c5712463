"""Horovod's collectives on torch.distributed, with Horovod's error semantics.

Before each collective the ranks exchange a small descriptor (operation, dtype, shape, root,
reduction). A mismatch raises the same error on every rank instead of hanging. Asynchronous
forms return a handle for `poll` and `synchronize`; two ops in flight under one name raise.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainaccel.comm.exchange import all_gather_single
from trainaccel.horovod.basics import _check
from trainaccel.horovod.compression import Compression, Compressor


class ReduceOp(enum.IntEnum):
    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product,
)  # fmt: skip

_TORCH_OPS = {
    ReduceOp.Average: dist.ReduceOp.SUM,
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}
_KINDS = {"allreduce": 1, "allgather": 2, "broadcast": 3, "alltoall": 4, "reducescatter": 5}
_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64, torch.bool]  # fmt: skip
_MAX_DIMS = 8


class Handle:
    """An operation in flight; pass it to `poll` or `synchronize`."""

    def __init__(self, name: str, work: Any, finish: Callable[[], Any]):
        self.name, self._work, self._finish = name, work, finish

    def __repr__(self) -> str:
        return f"<trainaccel.horovod handle {self.name!r}>"


_in_flight: dict[str, Handle] = {}
_auto_names = itertools.count()


def poll(handle: Handle) -> bool:
    """Whether the operation has finished (`synchronize` then returns without waiting)."""
    parts = getattr(handle, "_parts", None)
    if parts is not None:
        return all(poll(part) for part in parts)
    return handle._work is None or handle._work.is_completed()


def synchronize(handle: Handle) -> Any:
    """Wait for the operation and return its result."""
    try:
        if handle._work is not None:
            handle._work.wait()
        return handle._finish()
    finally:
        if _in_flight.get(handle.name) is handle:
            del _in_flight[handle.name]


def _start(kind: str, name: str | None, work: Any, finish: Callable[[], Any]) -> Handle:
    handle = Handle(name or f"{kind}.noname.{next(_auto_names)}", work, finish)
    _in_flight[handle.name] = handle
    return handle


def _claim(name: str | None) -> None:
    if name is not None and name in _in_flight:
        raise ValueError(
            f"an operation named {name!r} is already in flight; synchronize it first or choose another name"
        )


def _describe(kind: str, tensor: torch.Tensor, extra: int) -> torch.Tensor:
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"{kind}: tensors of more than {_MAX_DIMS} dimensions are not supported")
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"{kind}: dtype {tensor.dtype} is not supported; accepted: {', '.join(map(str, _DTYPES))}")
    shape = list(tensor.shape) + [-1] * (_MAX_DIMS - tensor.dim())
    return torch.tensor([_KINDS[kind], _DTYPES.index(tensor.dtype), tensor.dim(), extra, *shape], dtype=torch.int64)


def _negotiate(kind: str, name: str | None, tensor: torch.Tensor, extra: int = 0, *, first_dim_may_differ: bool = False) -> torch.Tensor:
    """Exchange descriptors; raise the same error on every rank if they disagree. Returns all descriptors."""
    mine = _describe(kind, tensor, extra)
    world = dist.get_world_size()
    everyone = torch.empty(world, mine.numel(), dtype=torch.int64)
    all_gather_single(everyone.view(-1), mine)
    label = f"{kind} {name!r}" if name else kind

    def differs(column: slice) -> bool:
        return bool((everyone[:, column] != everyone[0, column]).any())

    def listing(fmt: Callable[[torch.Tensor], str]) -> str:
        return ", ".join(f"rank {r} {fmt(everyone[r])}" for r in range(world))

    if differs(slice(0, 1)):
        raise RuntimeError(f"{label}: ranks called different operations ({listing(lambda d: _kind_name(int(d[0])))})")
    if differs(slice(1, 2)):
        raise RuntimeError(f"{label}: tensor dtypes differ across ranks ({listing(lambda d: str(_DTYPES[int(d[1])]))})")
    shape_from = 5 if first_dim_may_differ else 4
    if differs(slice(2, 3)) or differs(slice(shape_from, None)):
        what = "shapes (beyond the first dimension)" if first_dim_may_differ else "shapes"
        raise RuntimeError(f"{label}: tensor {what} differ across ranks ({listing(_shape_text)})")
    if differs(slice(3, 4)):
        if kind == "broadcast":
            raise RuntimeError(f"{label}: root ranks differ across ranks ({listing(lambda d: f'root {int(d[3])}')})")
        raise RuntimeError(f"{label}: reduction ops differ across ranks ({listing(lambda d: ReduceOp(int(d[3])).name)})")
    return everyone


def _kind_name(code: int) -> str:
    return next(k for k, v in _KINDS.items() if v == code)


def _shape_text(descriptor: torch.Tensor) -> str:
    ndim = int(descriptor[2])
    return str(tuple(int(x) for x in descriptor[4 : 4 + ndim]))


def _resolve_op(average: bool | None, op: ReduceOp | None) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("pass either average= (deprecated) or op=, not both")
    if average is not None:
        return Average if average else Sum
    op = Average if op is None else ReduceOp(op)
    if op == Adasum:
        raise ValueError("op=Adasum is not supported; accepted: Average, Sum, Min, Max, Product")
    return op


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> Handle:
    """Start reducing `tensor` in place across all workers."""
    _check()
    _no_process_set(process_set)
    _claim(name)
    op = _resolve_op(average, op)
    _negotiate("allreduce", name, tensor, int(op))
    if prescale_factor != 1.0:
        tensor.mul_(prescale_factor)
    work = dist.all_reduce(tensor, op=_TORCH_OPS[op], async_op=True)
    world = dist.get_world_size()

    def finish() -> torch.Tensor:
        if op == Average:
            if tensor.is_floating_point():
                tensor.div_(world)
            else:
                tensor.floor_divide_(world)
        if postscale_factor != 1.0:
            tensor.mul_(postscale_factor)
        return tensor

    return _start("allreduce", name, work, finish)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: ReduceOp | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: object = None) -> Handle:  # fmt: skip
    """Start reducing a copy of `tensor`; `synchronize` returns the result."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: ReduceOp | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: object = None) -> torch.Tensor:  # fmt: skip
    """Reduce `tensor` in place across all workers and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] | Compressor = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: object = None) -> torch.Tensor:  # fmt: skip
    """The reduction of `tensor` across all workers (Average by default), as a new tensor."""
    compressed, ctx = compression.compress(tensor.detach())
    if compressed.data_ptr() == tensor.data_ptr():
        compressed = compressed.clone()  # the result is a new tensor; the input stays as it was
    summed = synchronize(
        allreduce_async_(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    )
    return compression.decompress(summed, ctx)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: object = None) -> Handle:
    """Start concatenating every worker's `tensor` along the first dimension (sizes may differ)."""
    _check()
    _no_process_set(process_set)
    _claim(name)
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor of at least one dimension")
    everyone = _negotiate("allgather", name, tensor, first_dim_may_differ=True)
    firsts = [int(d) for d in everyone[:, 4]]
    longest = max(firsts)
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor.detach()
    gathered = padded.new_empty((len(firsts) * longest, *tensor.shape[1:]))
    work = all_gather_single(gathered, padded, async_op=True)

    def finish() -> torch.Tensor:
        parts = gathered.split(longest)
        return torch.cat([part[:n] for part, n in zip(parts, firsts)])

    return _start("allgather", name, work, finish)


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: object = None) -> torch.Tensor:
    """Every worker's `tensor` concatenated along the first dimension, in rank order."""
    return synchronize(allgather_async(tensor, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None) -> Handle:
    """Start overwriting `tensor` in place with the root's."""
    _check()
    _no_process_set(process_set)
    _claim(name)
    if not 0 <= root_rank < dist.get_world_size():
        raise ValueError(f"invalid root_rank={root_rank}; accepted: 0 to {dist.get_world_size() - 1}")
    _negotiate("broadcast", name, tensor, root_rank)
    work = dist.broadcast(tensor, src=root_rank, async_op=True)
    return _start("broadcast", name, work, lambda: tensor)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None) -> Handle:
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None) -> torch.Tensor:
    """The root's `tensor`, on every worker, as a new tensor."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def alltoall_async(tensor: torch.Tensor, splits: torch.Tensor | list[int] | None = None, name: str | None = None,
                   process_set: object = None) -> Handle:  # fmt: skip
    """Start sending `splits[j]` rows of `tensor` to rank j; `synchronize` returns (output, received_splits)."""
    _check()
    _no_process_set(process_set)
    _claim(name)
    world = dist.get_world_size()
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension")
    if splits is None:
        if tensor.shape[0] % world:
            raise ValueError(f"alltoall without splits needs the first dimension ({tensor.shape[0]}) divisible by size() ({world})")
        send = [tensor.shape[0] // world] * world
    else:
        send = [int(x) for x in (splits.tolist() if torch.is_tensor(splits) else splits)]
        if len(send) != world or any(x < 0 for x in send) or sum(send) != tensor.shape[0]:
            raise ValueError(
                f"invalid splits={send}; accepted: {world} non-negative counts that add up to the first dimension ({tensor.shape[0]})"
            )
    _negotiate("alltoall", name, tensor, first_dim_may_differ=True)
    received = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(received, torch.tensor(send, dtype=torch.int64))
    counts = [int(x) for x in received]
    output = tensor.new_empty((sum(counts), *tensor.shape[1:]))
    work = dist.all_to_all_single(output, tensor.detach().contiguous(), counts, send, async_op=True)
    return _start("alltoall", name, work, lambda: (output, received.to(torch.int32)))


def alltoall(tensor: torch.Tensor, splits: torch.Tensor | list[int] | None = None, name: str | None = None,
             process_set: object = None) -> Any:  # fmt: skip
    """Rows of every rank's `tensor` addressed to this one, in rank order; with `splits`, also the counts received."""
    output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | None = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: object = None) -> Handle:  # fmt: skip
    """Start reducing `tensor` across workers; this rank keeps its share of the first dimension."""
    _check()
    _no_process_set(process_set)
    _claim(name)
    op = _resolve_op(None, op)
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter supports op=Average or Sum, got {op.name}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    _negotiate("reducescatter", name, tensor, int(op))
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = [tensor.shape[0] // world + (1 if r < tensor.shape[0] % world else 0) for r in range(world)]
    start = sum(rows[:rank])
    # Gloo's reduce-scatter is slower than its allreduce, and needs equal shares: reduce all, keep ours.
    full = tensor.detach().clone()
    if prescale_factor != 1.0:
        full.mul_(prescale_factor)
    work = dist.all_reduce(full, async_op=True)

    def finish() -> torch.Tensor:
        mine = full.narrow(0, start, rows[rank]).clone()
        if op == Average:
            mine = mine / world if mine.is_floating_point() else mine.div(world, rounding_mode="floor")
        return mine.mul_(postscale_factor) if postscale_factor != 1.0 else mine

    return _start("reducescatter", name, work, finish)


def reducescatter(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: object = None) -> torch.Tensor:  # fmt: skip
    """This rank's share (rows split as evenly as possible, lower ranks first) of the reduction of `tensor`."""
    return synchronize(reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set))


def _group(kind: str, name: str | None, handles: list[Handle]) -> Handle:
    """One handle over several: done when all are, its result the list of theirs."""
    group = Handle(name or f"{kind}.noname.{next(_auto_names)}", None, lambda: [synchronize(h) for h in handles])
    group._parts = handles  # type: ignore[attr-defined]
    return group


def _named(name: str | None, i: int) -> str | None:
    return None if name is None else f"{name}.{i}"


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: object = None) -> Handle:  # fmt: skip
    """Start reducing each tensor of a list in place; `synchronize` returns the list."""
    _claim(name)
    handles = [allreduce_async_(t, average, _named(name, i), op, prescale_factor, postscale_factor, process_set)
               for i, t in enumerate(tensors)]  # fmt: skip
    return _group("grouped_allreduce", name, handles)


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: object = None) -> Handle:  # fmt: skip
    copies = [t.detach().clone() for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: object = None) -> list[torch.Tensor]:  # fmt: skip
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] | Compressor = Compression.none, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: object = None) -> list[torch.Tensor]:  # fmt: skip
    """The reduction of each tensor of a list, as new tensors."""
    return [allreduce(t, average, _named(name, i), compression, op, prescale_factor, postscale_factor, process_set)
            for i, t in enumerate(tensors)]  # fmt: skip


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None, process_set: object = None) -> Handle:
    _claim(name)
    return _group("grouped_allgather", name, [allgather_async(t, _named(name, i), process_set) for i, t in enumerate(tensors)])


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None, process_set: object = None) -> list[torch.Tensor]:
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None, op: ReduceOp | None = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: object = None) -> Handle:  # fmt: skip
    _claim(name)
    handles = [reducescatter_async(t, _named(name, i), op, prescale_factor, postscale_factor, process_set)
               for i, t in enumerate(tensors)]  # fmt: skip
    return _group("grouped_reducescatter", name, handles)


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, op: ReduceOp | None = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: object = None) -> list[torch.Tensor]:  # fmt: skip
    return synchronize(grouped_reducescatter_async(tensors, name, op, prescale_factor, postscale_factor, process_set))


def barrier(process_set: object = None) -> None:
    _check()
    _no_process_set(process_set)
    dist.barrier()


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: object = None) -> Any:
    """The root's `obj` on every worker (pickled, as in Horovod)."""
    _check()
    _no_process_set(process_set)
    holder = [obj if dist.get_rank() == root_rank else None]
    dist.broadcast_object_list(holder, src=root_rank)
    return holder[0]


def allgather_object(obj: Any, name: str | None = None, process_set: object = None) -> list[Any]:
    """Every worker's `obj`, in rank order."""
    _check()
    _no_process_set(process_set)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _no_process_set(process_set: object) -> None:
    if process_set is not None:
        raise ValueError("process sets are not supported yet; leave process_set unset to use all workers")
