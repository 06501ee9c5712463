"""Dynamic tables sharded over the ranks of a c10d group (model parallel), on Gloo or NCCL.

Row-wise sharding spreads each table's keys over all ranks by a hash of the key; table-wise places
whole tables on ranks. A lookup sends each rank's unique keys to their owners and gets the rows back
in one all-to-all per step for all tables together; `step()` of a sparse optimizer sends the rows'
gradients back to the owners, which update them. Bags are pooled on the requesting rank.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from trainaccel.embedding.dynamic import DynamicEmbedding, check_keys
from trainaccel.embedding.hashing import combine

SHARDINGS = ("row", "table")
_OWNER_SALT = 0x0A11CE  # owners use a different hash from the index's slots, so each shard still fills all slots


def _table_options(name: str, spec: int | Mapping[str, Any]) -> dict[str, Any]:
    options = {"dim": spec} if isinstance(spec, int) and not isinstance(spec, bool) else dict(spec)
    if "dim" not in options:
        raise ValueError(
            f"invalid table {name!r}: {spec!r}; accepted: a dim or a dict of DynamicEmbedding options with 'dim'"
        )
    DynamicEmbedding(**{**options, "initial_capacity": 1})  # check the options here, on every rank alike
    return options


def row_owner(keys: torch.Tensor, world: int) -> torch.Tensor:
    """The rank that holds each key under row-wise sharding over `world` ranks."""
    h = combine(keys, _OWNER_SALT)
    return ((h >> 1) & ((1 << 62) - 1)) % world


class _Exchange:
    """What a lookup sent and received, kept until the step sends the gradients back."""

    def __init__(
        self, received: torch.Tensor, served: torch.Tensor, requested_splits: list[int], served_splits: list[int]
    ):
        self.received, self.served = received, served  # rows this rank asked for; rows it served to others
        self.requested_splits, self.served_splits = requested_splits, served_splits


class ShardedEmbeddingCollection(nn.Module):
    """Named DynamicEmbedding tables sharded row-wise or table-wise over a process group."""

    def __init__(
        self,
        tables: Mapping[str, int | Mapping[str, Any]],
        *,
        sharding: str = "row",
        placement: Mapping[str, int] | None = None,
        process_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        if sharding not in SHARDINGS:
            raise ValueError(f"invalid sharding {sharding!r}; accepted: {', '.join(SHARDINGS)}")
        if not tables:
            raise ValueError("no tables; accepted: a mapping of names to dims or DynamicEmbedding options")
        self.options = {name: _table_options(name, spec) for name, spec in tables.items()}
        self.names = list(self.options)
        self.sharding = sharding
        self.group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.world = dist.get_world_size(process_group) if distributed else 1
        self.placement = self._place(placement)
        self.shards = nn.ModuleDict(
            {name: DynamicEmbedding(**self.options[name]) for name in self.names if self.holds(name)}
        )
        for shard in self.shards.values():
            shard.is_shard = True
        self._exchanges: list[_Exchange] = []
        self.bytes_sent = 0  # to other ranks, keys, rows and gradients: for benchmarks and monitoring
        self._uniform_dim = len({self.dim(n) for n in self.names}) == 1  # rows move as [n, dim], no flat index

    def _place(self, placement: Mapping[str, int] | None) -> dict[str, int]:
        if self.sharding == "row":
            if placement:
                raise ValueError("placement is for table-wise sharding; row-wise spreads every table over all ranks")
            return {}
        placement = dict(placement or {name: i % self.world for i, name in enumerate(self.names)})
        bad = {
            n: r
            for n, r in placement.items()
            if n not in self.options or not isinstance(r, int) or not 0 <= r < self.world
        }
        if bad or set(placement) != set(self.names):
            raise ValueError(
                f"invalid placement {placement!r}; accepted: every table name mapped to a rank in [0, {self.world})"
            )
        return placement

    def holds(self, name: str) -> bool:
        """Whether this rank holds (a shard of) table `name`."""
        return self.sharding == "row" or self.placement[name] == self.rank

    def owners(self, name: str, keys: torch.Tensor) -> torch.Tensor:
        """The owning rank of each key of table `name`."""
        if self.sharding == "table":
            return torch.full_like(keys, self.placement[name])
        return row_owner(keys, self.world)

    def dim(self, name: str) -> int:
        return self.options[name]["dim"]

    def extra_repr(self) -> str:
        return f"sharding={self.sharding}, rank={self.rank}/{self.world}, tables={self.names}"

    def __getitem__(self, name: str) -> ShardedTable:
        if name not in self.options:
            raise KeyError(f"no table {name!r}; tables: {', '.join(self.names)}")
        return ShardedTable(self, name)

    # -- lookups ---------------------------------------------------------------------------

    def rows(
        self, requests: Mapping[str, torch.Tensor], counts: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Rows [n, dim] of unique keys per table, fetched from their owners in one exchange."""
        training = self.training and torch.is_grad_enabled()
        names = list(requests)
        keys_by_table = [check_keys(requests[n]).reshape(-1) for n in names]
        counts_by_table = [
            (counts[n].reshape(-1).to(torch.int64) if counts and n in counts else torch.ones_like(k))
            for n, k in zip(names, keys_by_table)
        ]
        device = keys_by_table[0].device
        table_ids = torch.tensor([self.names.index(n) for n in names], device=device)
        per_table = torch.tensor([k.numel() for k in keys_by_table], device=device)
        table_of = torch.repeat_interleave(table_ids, per_table)
        owner = torch.cat([self.owners(n, k) for n, k in zip(names, keys_by_table)])
        # Grouped by destination rank, then by table: the layout both sides agree on.
        order = torch.argsort(owner * len(self.names) + table_of, stable=True)
        send = torch.stack([torch.cat(keys_by_table), torch.cat(counts_by_table)], 1)[order]
        send_matrix = torch.bincount(owner * len(self.names) + table_of, minlength=self.world * len(self.names))
        recv_matrix = self._all_to_all(send_matrix, [len(self.names)] * self.world, [len(self.names)] * self.world)
        send_matrix, recv_matrix = send_matrix.view(self.world, -1), recv_matrix.view(self.world, -1)
        received = self._all_to_all(send, send_matrix.sum(1).tolist(), recv_matrix.sum(1).tolist())

        # Owner side: look the received keys up in the local shards, in received order.
        dims = torch.tensor([self.dim(n) for n in self.names], device=device)
        recv_table = torch.repeat_interleave(
            torch.arange(len(self.names), device=device).repeat(self.world), recv_matrix.reshape(-1)
        )
        rows_out = self._gather_local(received, recv_table, dims)
        requested_splits, served_splits = (send_matrix * dims).sum(1).tolist(), (recv_matrix * dims).sum(1).tolist()
        back = self._all_to_all(rows_out, served_splits, requested_splits)
        if training:
            back.requires_grad_(True)
            self._exchanges.append(_Exchange(back, rows_out, requested_splits, served_splits))

        # Requester side: rows in sorted order -> per table, in the order asked.
        widths = dims[table_of[order]]
        starts = torch.cumsum(widths, 0) - widths
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=device)
        out, first = {}, 0
        for name, keys in zip(names, keys_by_table):
            position = unsort[first : first + keys.numel()]
            first += keys.numel()
            if self._uniform_dim:
                out[name] = back.view(-1, self.dim(name)).index_select(0, position)
            else:
                index = starts[position].unsqueeze(1) + torch.arange(self.dim(name), device=device)
                out[name] = back[index]
        return out

    def _gather_local(self, received: torch.Tensor, recv_table: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
        """Flat rows for the received (key, count) pairs, each row dim(table) wide, in received order."""
        widths = dims[recv_table]
        starts = torch.cumsum(widths, 0) - widths
        dtype = next((s.weight.dtype for s in self.shards.values()), torch.float32)
        flat = torch.zeros(int(widths.sum()), dtype=dtype, device=received.device)
        for t, name in enumerate(self.names):
            mine = torch.nonzero(recv_table == t).squeeze(1)
            if not mine.numel():
                continue
            keys, counts = received[mine, 0], received[mine, 1]
            unique, inverse = torch.unique(keys, return_inverse=True)
            total = torch.zeros_like(unique).index_add_(0, inverse, counts)
            rows = self.shards[name].rows_for(unique, total).index_select(0, inverse)
            if self._uniform_dim:  # whole rows in place; out of place, so autograd reaches the shard
                flat = flat.view(-1, self.dim(name)).index_copy(0, mine, rows).view(-1)
            else:
                index = (starts[mine].unsqueeze(1) + torch.arange(self.dim(name), device=keys.device)).reshape(-1)
                flat = flat.index_put((index,), rows.reshape(-1))
        return flat

    def _all_to_all(self, tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        if self.world == 1:
            return tensor.detach().clone()
        row_bytes = tensor.element_size() * (tensor[0].numel() if tensor.dim() > 1 else 1)
        self.bytes_sent += (sum(send_splits) - send_splits[self.rank]) * row_bytes
        out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.detach().contiguous(), recv_splits, send_splits, group=self.group)
        return out

    def forward(
        self,
        features: Mapping[str, Any],
        *,
        weights: Mapping[str, Any] | None = None,
        offsets: Mapping[str, torch.Tensor] | None = None,
        combiner: str = "sum",
    ) -> dict[str, torch.Tensor]:
        """Pooled [B, dim] per table from bags of ids in any `embedding_lookup_sparse` layout."""
        from trainaccel.embedding.lookup import check_combiner, pool, to_bags

        check_combiner(combiner)  # before the exchange changes any table
        unknown = [n for n in features if n not in self.options]
        if unknown:
            raise KeyError(f"no tables {unknown}; tables: {', '.join(self.names)}")
        bags = {n: to_bags(ids, (weights or {}).get(n), (offsets or {}).get(n)) for n, ids in features.items()}
        uniques = {n: torch.unique(b.values, return_inverse=True, return_counts=True) for n, b in bags.items()}
        rows = self.rows({n: u[0] for n, u in uniques.items()}, {n: u[2] for n, u in uniques.items()})
        return {name: pool(b, rows[name], uniques[name][1], combiner) for name, b in bags.items()}

    # -- training --------------------------------------------------------------------------

    def exchange_gradients(self) -> None:
        """Send the gradients of the rows fetched since the last step back to their owners' shards."""
        for ex in self._exchanges:
            grad = ex.received.grad if ex.received.grad is not None else torch.zeros_like(ex.received)
            back = self._all_to_all(grad, ex.requested_splits, ex.served_splits)
            if ex.served.requires_grad:
                torch.autograd.backward(ex.served, back)
        self._exchanges.clear()

    def __len__(self) -> int:
        """Rows held on this rank, over all tables."""
        return sum(len(s) for s in self.shards.values())


class ShardedTable(nn.Module):
    """One table of a collection, usable wherever a DynamicEmbedding is (lookups, embedding_lookup_sparse)."""

    def __init__(self, collection: ShardedEmbeddingCollection, name: str):
        super().__init__()
        self.collection, self.name, self.dim = collection, name, collection.dim(name)

    def rows_for(self, keys: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        return self.collection.rows({self.name: keys}, None if counts is None else {self.name: counts})[self.name]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = check_keys(ids)
        unique, inverse, counts = torch.unique(ids.reshape(-1), return_inverse=True, return_counts=True)
        return self.rows_for(unique, counts)[inverse].reshape(*ids.shape, self.dim)


_VARIABLES: dict[str, ShardedEmbeddingCollection] = {}


def get_variable(
    name: str,
    dim: int,
    initializer: Any = None,
    *,
    sharding: str = "row",
    process_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> ShardedTable:
    """A dynamic table sharded over all ranks, created on first use and returned again by name afterwards."""
    if name in _VARIABLES:
        existing = _VARIABLES[name]
        if existing.dim(name) != dim:
            raise ValueError(f"variable {name!r} exists with dim {existing.dim(name)}, not {dim}")
        return existing[name]
    collection = ShardedEmbeddingCollection(
        {name: {"dim": dim, "initializer": initializer, **options}}, sharding=sharding, process_group=process_group
    )
    _VARIABLES[name] = collection
    return collection[name]
