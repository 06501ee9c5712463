"""Before each collective the workers exchange a small descriptor; this is also how `join` works.

A descriptor holds the operation, dtype, shape, one extra field (reduction op or root), the
operation's name and whether it may wait. When descriptors disagree, every worker raises the
same error instead of hanging in the collective. A worker in `join()` keeps answering the
exchange with a join descriptor and, for allreduce, contributes the reduction's identity, so
workers with more data go on.

Operations are matched in call order, except that an asynchronous operation with an explicit
name which meets a different operation elsewhere is parked, as Horovod's coordinator would
leave it pending: this worker goes on, the others retry their operation, and the parked one
starts in the exchange where every worker has it parked or is calling it.

As Horovod's response cache: a descriptor every worker agreed on is kept, numbered alike on
every worker (at most CACHE_SIZE). Each exchange first all-reduces that number (0: not kept,
or something parked): where every worker calls the same kept one, that is the whole exchange,
16 bytes however many workers (DistributedOptimizer's buckets, every step after the first);
otherwise the descriptors are gathered as above.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
import torch.distributed as dist

from trainaccel.comm.exchange import all_gather_single
from trainaccel.devices import group_device
from trainaccel.horovod import background
from trainaccel.horovod.process_sets import ProcessSet

KINDS = {
    "allreduce": 1,
    "allgather": 2,
    "broadcast": 3,
    "alltoall": 4,
    "reducescatter": 5,
    "barrier": 6,
    "object": 7,
    "join": 8,
}
DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
]
MAX_DIMS = 8
OP_NAMES = ["Average", "Sum", "Adasum", "Min", "Max", "Product"]  # ReduceOp's values index this list
_HEAD = 4  # kind, dtype, ndim, extra; the shape follows
NAME = _HEAD + MAX_DIMS  # after the shape: the explicit name's key (0: no name)
PARKABLE = NAME + 1  # 1: may be parked (asynchronous, explicitly named)
PARKED = NAME + 2  # how many operations this worker has parked in this process set
WIDTH = NAME + 3

_OPS = 16  # an allreduce's extra field is op + _OPS * (buffers of its fused group)


def pack_op(op: int, fused_buffers: int = 1) -> int:
    return op + _OPS * fused_buffers


_rounds: dict[int, int] = {}  # exchanges so far per process set id: the same count on every member
CACHE_SIZE = 1024  # descriptors kept per process set (Horovod's default cache capacity)
# per process set id: {descriptor's bytes (without the parking fields): (its number, every worker's descriptor)}
_cache: dict[int, dict[bytes, tuple[int, torch.Tensor]]] = {}
_hits: dict[int, int] = {}  # exchanges per process set id that a kept descriptor settled (for tests)


class Operation:
    """One collective of this worker: its descriptor, and how to start it once every worker agrees."""

    def __init__(
        self,
        kind: str,
        name: str | None,
        tensor: torch.Tensor,
        extra: int = 0,
        among: ProcessSet | None = None,
        first_dim_may_differ: bool = False,
        start: Callable[[torch.Tensor], None] | None = None,
    ):
        self.kind, self.name, self.among = kind, name, among
        self.descriptor = describe(kind, tensor, extra, name)
        self.first_dim_may_differ = first_dim_may_differ
        self.start = start  # launches the collective, given every worker's descriptor
        self.error: Exception | None = None  # why a parked operation could not start

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name!r}" if self.name else self.kind

    @property
    def set_id(self) -> int:
        return (self.among.process_set_id or 0) if self.among is not None else 0


_parked: dict[int, list[Operation]] = {}  # per process set, in the order they were parked


def reset() -> None:
    _rounds.clear()
    _parked.clear()
    _cache.clear()
    _hits.clear()
    background.reset()


def cache_hits(set_id: int = 0) -> int:
    """How many exchanges of the process set a kept descriptor settled (16 bytes each, not every worker's)."""
    return _hits.get(set_id, 0)


def exchanges(set_id: int) -> int:
    """How many descriptor exchanges the process set has made: at matching calls, equal on its members."""
    return _rounds.get(set_id, 0)


def name_key(name: str | None) -> int:
    """A name's key in descriptors: the same on every worker (Python's hash() is salted per process)."""
    if name is None:
        return 0
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1 or 1


def describe(kind: str, tensor: torch.Tensor, extra: int = 0, name: str | None = None) -> torch.Tensor:
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"{kind}: tensors of more than {MAX_DIMS} dimensions are not supported")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"{kind}: dtype {tensor.dtype} is not supported; accepted: {', '.join(map(str, DTYPES))}")
    shape = list(tensor.shape) + [-1] * (MAX_DIMS - tensor.dim())
    return torch.tensor(
        [KINDS[kind], DTYPES.index(tensor.dtype), tensor.dim(), extra, *shape, name_key(name), 0, 0], dtype=torch.int64
    )


def _kept(mine: torch.Tensor | None, group: dist.ProcessGroup | None, set_id: int) -> torch.Tensor | None:
    """Every worker's descriptor, where every worker calls the one kept under the same number (else None, alike on
    every worker: then they gather descriptors). `mine` None, or with operations parked here: never kept."""
    kept = _cache.get(set_id, {}).get(_body(mine)) if mine is not None and int(mine[PARKED]) == 0 else None
    number = kept[0] if kept is not None else 0
    background.drain()  # the optimizer's exchanges submitted so far come first, as on one thread
    probe = torch.tensor([number, -number], dtype=torch.int64, device=group_device(group))
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    _rounds[set_id] = _rounds.get(set_id, 0) + 1
    most, least = probe[0].item(), -probe[1].item()
    if number == 0 or most != least:
        return None
    _hits[set_id] = _hits.get(set_id, 0) + 1
    return kept[1].clone()


def _keep(everyone: torch.Tensor, set_id: int) -> None:
    """Keep descriptors every worker sent alike (nothing parked): the same number on every worker."""
    cache = _cache.setdefault(set_id, {})
    first = everyone[0]
    if len(cache) < CACHE_SIZE and int(first[PARKED]) == 0 and bool((everyone == first).all()):
        cache.setdefault(_body(first), (len(cache) + 1, everyone.clone()))


def _body(descriptor: torch.Tensor) -> bytes:
    return descriptor[:PARKABLE].numpy().tobytes() + descriptor[PARKABLE + 1 :].numpy().tobytes()


def _gather(mine: torch.Tensor, group: dist.ProcessGroup | None, set_id: int) -> torch.Tensor:
    """Every worker's descriptor, read here on the CPU (exchanged on the group's device: an NCCL-only group's GPU)."""
    background.drain()  # the optimizer's exchanges submitted so far come first, as on one thread
    world, device = dist.get_world_size(group), group_device(group)
    everyone = torch.empty(world, mine.numel(), dtype=torch.int64, device=device)
    all_gather_single(everyone.view(-1), mine.to(device), group=group)
    _rounds[set_id] = _rounds.get(set_id, 0) + 1
    return everyone.cpu()


def mismatch(
    everyone: torch.Tensor,
    rows: list[int],
    label: str,
    *,
    first_dim_may_differ: bool = False,
    ranks: list[int] | None = None,
) -> str | None:
    """The error the workers in `rows` raise for their descriptors, or None when they agree.

    `ranks` are the global ranks of the rows (a process set's members), for the message.
    Names are not compared here: `_settle` decides which operations meet.
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
    if differs(slice(2, 3)) or differs(slice(_HEAD + (1 if first_dim_may_differ else 0), NAME)):
        what = "shapes (beyond the first dimension)" if first_dim_may_differ else "shapes"
        return f"{label}: tensor {what} differ across ranks ({listing(_shape_text)})"
    if differs(slice(3, 4)):
        if kind == "allreduce" and len({int(d) % _OPS for d in sub[:, 3]}) == 1:
            counts = listing(lambda d: f"{int(d[3]) // _OPS} dtypes")
            return f"{label}: grouped tensors' dtypes differ across ranks ({counts})"
        if kind == "broadcast":
            return f"{label}: root ranks differ across ranks ({listing(lambda d: f'root {int(d[3])}')})"
        return f"{label}: reduction ops differ across ranks ({listing(lambda d: OP_NAMES[int(d[3]) % _OPS])})"
    return None


def negotiate(
    kind: str,
    name: str | None,
    tensor: torch.Tensor,
    extra: int = 0,
    *,
    among: ProcessSet | None = None,
    first_dim_may_differ: bool = False,
) -> torch.Tensor:
    """Exchange descriptors among a process set (all workers by default); raise on every one if they disagree."""
    everyone = _settle(Operation(kind, name, tensor, extra, among, first_dim_may_differ), parkable=False)
    assert everyone is not None
    return everyone


def submit(op: Operation, parkable: bool) -> bool:
    """Start `op` (True), or park it until the other workers reach it (False; only when `parkable`)."""
    everyone = _settle(op, parkable)
    if everyone is None:
        return False
    assert op.start is not None
    op.start(everyone)
    return True


def finish_parked(op: Operation) -> None:
    """Wait, exchanging descriptors, until a parked `op` can start, and start it; raise if it cannot."""
    waiting = _parked.get(op.set_id, [])
    if op in waiting:
        waiting.remove(op)
        submit(op, parkable=False)
    if op.error is not None:
        raise op.error


def _settle(op: Operation, parkable: bool) -> torch.Tensor | None:
    """Exchange descriptors until `op` may start (every worker's descriptor) or is parked (None)."""
    group, ranks = (op.among.group, op.among.ranks) if op.among is not None else (None, None)
    waiting = _parked.setdefault(op.set_id, [])
    while True:
        mine = op.descriptor.clone()
        mine[PARKABLE], mine[PARKED] = int(parkable), len(waiting)
        everyone = _kept(mine, group, op.set_id)
        if everyone is not None:
            return everyone  # every worker calls this very operation, which they agreed on before
        everyone = _gather(mine, group, op.set_id)
        rows = list(range(everyone.shape[0]))
        joined = [r for r in rows if int(everyone[r, 0]) == KINDS["join"]]
        if joined:  # call order only: a joined worker answers allreduce, whatever is parked
            if op.kind != "allreduce":
                raise RuntimeError(f"{op.label}: ranks {joined} have joined; after hvd.join() only allreduce goes on")
            active = [r for r in rows if r not in joined]
            error = mismatch(everyone, active, op.label, first_dim_may_differ=op.first_dim_may_differ, ranks=ranks)
            if error:
                raise RuntimeError(error)
            return everyone
        parked = _parked_descriptors(everyone, waiting, group, op.set_id)
        ready = _ready(everyone, parked)
        if ready:
            # Every worker has this name parked or is calling it: it starts now, everywhere.
            chosen = torch.stack(
                [
                    everyone[r]
                    if int(everyone[r, NAME]) == ready
                    else next(d for d in parked[r] if int(d[NAME]) == ready)
                    for r in rows
                ]
            )
            me = dist.get_rank(group)
            theirs = None if int(everyone[me, NAME]) == ready else next(w for w in waiting if name_key(w.name) == ready)
            first_dim = (theirs or op).first_dim_may_differ
            label = (theirs or op).label
            error = mismatch(chosen, rows, label, first_dim_may_differ=first_dim, ranks=ranks)
            if theirs is None:
                if error:
                    raise RuntimeError(error)
                return chosen
            waiting.remove(theirs)
            if error:
                theirs.error = RuntimeError(error)  # raised by its synchronize; this call goes on
            else:
                assert theirs.start is not None
                theirs.start(chosen)
            continue
        names = {int(everyone[r, NAME]) for r in rows} - {0}
        may_wait = [r for r in rows if int(everyone[r, PARKABLE])]
        same_kind = bool((everyone[:, 0] == everyone[0, 0]).all())
        # A name some worker has parked must not be matched with another operation by call order.
        clash = any(int(d[NAME]) in names for theirs in parked for d in theirs)
        if same_kind and not clash and (len(names) <= 1 or not may_wait):
            error = mismatch(everyone, rows, op.label, first_dim_may_differ=op.first_dim_may_differ, ranks=ranks)
            if error:
                raise RuntimeError(error)
            _keep(everyone, op.set_id)
            return everyone
        if may_wait and not _one_name_two_kinds(everyone):
            if parkable:
                waiting.append(op)
                return None
            continue  # the parking workers go on to their next operation, which this one meets
        raise RuntimeError(
            mismatch(everyone, rows, op.label, ranks=ranks) or f"{op.label}: ranks called differently named operations"
        )


def _parked_descriptors(
    everyone: torch.Tensor, waiting: list[Operation], group: dist.ProcessGroup | None, set_id: int
) -> list[list[torch.Tensor]]:
    """Each worker's parked operations' descriptors; a second exchange, only while some worker has any."""
    most = int(everyone[:, PARKED].max())
    if most == 0:
        return [[] for _ in range(everyone.shape[0])]
    mine = torch.zeros(most, WIDTH, dtype=torch.int64)  # kind 0: padding
    for i, parked in enumerate(waiting):
        mine[i] = parked.descriptor
    theirs = _gather(mine.view(-1), group, set_id).view(everyone.shape[0], most, WIDTH)
    return [[d for d in rows if int(d[0])] for rows in theirs]


def _ready(everyone: torch.Tensor, parked: list[list[torch.Tensor]]) -> int:
    """A parked name every worker has parked or is calling now (0: none), chosen alike everywhere."""
    names = [{int(d[NAME]) for d in rows} | {int(everyone[r, NAME])} for r, rows in enumerate(parked)]
    for rows in parked:
        for d in rows:
            if all(int(d[NAME]) in theirs for theirs in names):
                return int(d[NAME])
    return 0


def _one_name_two_kinds(everyone: torch.Tensor) -> bool:
    kinds: dict[int, int] = {}
    for d in everyone:
        name = int(d[NAME])
        if name and kinds.setdefault(name, int(d[0])) != int(d[0]):
            return True
    return False


def join(device: torch.device) -> int:
    """Take part in the others' allreduces with the identity until every worker has joined.

    The identity tensors live on `device`, which must be where the others' tensors are (NCCL
    reduces CUDA tensors, Gloo CPU ones). Returns the rank that joined last, the same everywhere.
    """
    joined_at = exchanges(0)
    while True:
        _kept(None, None, 0)  # the others' first step of each exchange (a join's is never kept)
        everyone = _gather(describe("join", torch.zeros(1, dtype=torch.int64), joined_at), None, 0)
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


TORCH_OPS = {
    "Average": dist.ReduceOp.SUM,
    "Sum": dist.ReduceOp.SUM,
    "Min": dist.ReduceOp.MIN,
    "Max": dist.ReduceOp.MAX,
    "Product": dist.ReduceOp.PRODUCT,
}


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
