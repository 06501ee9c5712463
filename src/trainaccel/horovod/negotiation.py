"""Before each collective the workers exchange a small descriptor; this is also how `join` works.

A descriptor holds the operation, dtype, shape and one extra field (reduction op or root).
When descriptors disagree, every worker raises the same error instead of hanging in the
collective. A worker in `join()` keeps answering the exchange with a join descriptor and,
for allreduce, contributes the reduction's identity, so workers with more data go on.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from trainaccel.comm.exchange import all_gather_single
from trainaccel.horovod.process_sets import ProcessSet

KINDS = {"allreduce": 1, "allgather": 2, "broadcast": 3, "alltoall": 4, "reducescatter": 5,
         "barrier": 6, "object": 7, "join": 8}  # fmt: skip
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]  # fmt: skip
MAX_DIMS = 8
OP_NAMES = ["Average", "Sum", "Adasum", "Min", "Max", "Product"]  # ReduceOp's values index this list
_HEAD = 4  # kind, dtype, ndim, extra; the shape follows

_OPS = 16  # an allreduce's extra field is op + _OPS * (buffers of its fused group)


def pack_op(op: int, fused_buffers: int = 1) -> int:
    return op + _OPS * fused_buffers


_rounds = 0  # exchanges over the whole world so far: the same count on every worker


def reset() -> None:
    global _rounds
    _rounds = 0


def describe(kind: str, tensor: torch.Tensor, extra: int = 0) -> torch.Tensor:
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"{kind}: tensors of more than {MAX_DIMS} dimensions are not supported")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"{kind}: dtype {tensor.dtype} is not supported; accepted: {', '.join(map(str, DTYPES))}")
    shape = list(tensor.shape) + [-1] * (MAX_DIMS - tensor.dim())
    return torch.tensor([KINDS[kind], DTYPES.index(tensor.dtype), tensor.dim(), extra, *shape], dtype=torch.int64)


def _gather(mine: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    global _rounds
    world = dist.get_world_size(group)
    everyone = torch.empty(world, mine.numel(), dtype=torch.int64)
    all_gather_single(everyone.view(-1), mine, group=group)
    if group is None:
        _rounds += 1
    return everyone


def mismatch(everyone: torch.Tensor, rows: list[int], label: str, *, first_dim_may_differ: bool = False,
             ranks: list[int] | None = None) -> str | None:  # fmt: skip
    """The error the workers in `rows` raise for their descriptors, or None when they agree.

    `ranks` are the global ranks of the rows (a process set's members), for the message.
    """
    kind = next(k for k, v in KINDS.items() if v == int(everyone[rows[0], 0]))
    sub = everyone[rows]

    def differs(column: slice) -> bool:
        return bool((sub[:, column] != sub[0, column]).any())

    def listing(fmt: Callable[[torch.Tensor], str]) -> str:
        return ", ".join(f"rank {ranks[r] if ranks else r} {fmt(everyone[r])}" for r in rows)

    if differs(slice(0, 1)):
        return f"{label}: ranks called different operations ({listing(lambda d: _kind_name(int(d[0])))})"
    if differs(slice(1, 2)):
        return f"{label}: tensor dtypes differ across ranks ({listing(lambda d: str(DTYPES[int(d[1])]))})"
    if differs(slice(2, 3)) or differs(slice(_HEAD + (1 if first_dim_may_differ else 0), None)):
        what = "shapes (beyond the first dimension)" if first_dim_may_differ else "shapes"
        return f"{label}: tensor {what} differ across ranks ({listing(_shape_text)})"
    if differs(slice(3, 4)):
        if kind == "allreduce" and len({int(d) % _OPS for d in sub[:, 3]}) == 1:
            return f"{label}: grouped tensors' dtypes differ across ranks ({listing(lambda d: f'{int(d[3]) // _OPS} dtypes')})"
        if kind == "broadcast":
            return f"{label}: root ranks differ across ranks ({listing(lambda d: f'root {int(d[3])}')})"
        return f"{label}: reduction ops differ across ranks ({listing(lambda d: OP_NAMES[int(d[3]) % _OPS])})"
    return None


def negotiate(kind: str, name: str | None, tensor: torch.Tensor, extra: int = 0, *, among: ProcessSet | None = None,
              first_dim_may_differ: bool = False) -> torch.Tensor:  # fmt: skip
    """Exchange descriptors among a process set (all workers by default); raise on every one if they disagree."""
    group, ranks = (among.group, among.ranks) if among is not None else (None, None)
    everyone = _gather(describe(kind, tensor, extra), group)
    label = f"{kind} {name!r}" if name else kind
    joined = [r for r in range(everyone.shape[0]) if int(everyone[r, 0]) == KINDS["join"]]
    if joined and kind != "allreduce":
        raise RuntimeError(f"{label}: ranks {joined} have joined; after hvd.join() only allreduce goes on")
    active = [r for r in range(everyone.shape[0]) if r not in joined]
    error = mismatch(everyone, active, label, first_dim_may_differ=first_dim_may_differ, ranks=ranks)
    if error:
        raise RuntimeError(error)
    return everyone


def join(device: torch.device) -> int:
    """Take part in the others' allreduces with the identity until every worker has joined.

    The identity tensors live on `device`, which must be where the others' tensors are (NCCL
    reduces CUDA tensors, Gloo CPU ones). Returns the rank that joined last, the same everywhere.
    """
    joined_at = _rounds
    while True:
        everyone = _gather(describe("join", torch.zeros(1, dtype=torch.int64), joined_at), None)
        active = [r for r in range(everyone.shape[0]) if int(everyone[r, 0]) != KINDS["join"]]
        if not active:
            return max(range(everyone.shape[0]), key=lambda r: (int(everyone[r, 3]), r))
        first = everyone[active[0]]
        if int(first[0]) != KINDS["allreduce"] or mismatch(everyone, active, "allreduce"):
            continue  # the active workers raise without starting a collective
        dtype = DTYPES[int(first[1])]
        dtype = torch.int32 if dtype == torch.int16 else dtype  # the others widen int16 for Gloo
        shape = [int(x) for x in first[_HEAD : _HEAD + int(first[2])]]
        op = OP_NAMES[int(first[3]) % _OPS]
        dist.all_reduce(identity(op, shape, dtype).to(device), op=TORCH_OPS[op])


TORCH_OPS = {"Average": dist.ReduceOp.SUM, "Sum": dist.ReduceOp.SUM, "Min": dist.ReduceOp.MIN,
             "Max": dist.ReduceOp.MAX, "Product": dist.ReduceOp.PRODUCT}  # fmt: skip


def identity(op: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """What a joined worker contributes: leaves the others' reduction unchanged."""
    if op == "Product":
        return torch.ones(shape, dtype=dtype)
    if op in ("Min", "Max"):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype) if dtype != torch.bool else None
        fill = (op == "Min") if info is None else (info.max if op == "Min" else info.min)
        return torch.full(shape, fill, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def _kind_name(code: int) -> str:
    return next(k for k, v in KINDS.items() if v == code)


def _shape_text(descriptor: torch.Tensor) -> str:
    ndim = int(descriptor[2])
    return str(tuple(int(x) for x in descriptor[_HEAD : _HEAD + ndim]))
