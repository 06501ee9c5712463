"""`DynamicEmbedding`: a collision-free embedding table over int64 keys that grows on demand.

Rows are created when a key has been seen `admit_after` times, trained only through the sparse
optimizers of `trainaccel.embedding.optim`, and evicted by TTL (steps unseen) or by capacity (LFU).
A row's optimizer state lives beside it and is created, evicted and exported with it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from trainaccel.embedding import initializers
from trainaccel.embedding.hashing import PENDING, KeyIndex

_INT32_MAX = 2**31 - 1
_PENDING_WARNING = 1024  # training lookups held for a step that may never come
_INDEX_LOAD = 0.35  # the index is sized for this load up front and grows when it passes 0.7
_NAMES = {"keys", "weight", "counts", "last_seen", "pending_keys", "pending_counts", "pending_last_seen", "step"}


def _positive_int(name: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        accepted = "an integer >= 1" + (" or None" if allow_none else "")
        raise ValueError(f"invalid {name} {value!r}; accepted: {accepted}")
    return value


def check_keys(ids: torch.Tensor, what: str = "ids") -> torch.Tensor:
    """Integer ids as int64, or a clear error."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"invalid {what} of type {type(ids).__name__}; accepted: an integer torch.Tensor")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"invalid {what} dtype {ids.dtype}; accepted: an integer dtype (torch.int64, torch.int32, ...)")
    return ids.to(torch.int64)


def _warn_if_replicated(table: DynamicEmbedding) -> None:
    """A plain table in a multi-worker job is trained separately by each worker: say so once."""
    import torch.distributed as dist

    if not table.is_shard and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            "a DynamicEmbedding is being trained in a job of several workers: nothing synchronizes it, so each "
            "worker trains its own copy. Use ShardedEmbeddingCollection (or get_variable) to share one table.",
            stacklevel=4,
        )


class DynamicEmbedding(nn.Module):
    """An embedding table keyed by any int64 values, with admission, eviction and per-row optimizer state."""

    def __init__(
        self,
        dim: int,
        *,
        initializer: initializers.Initializer | str | float | None = None,
        admit_after: int = 1,
        ttl: int | None = None,
        capacity: int | None = None,
        evict_every: int = 1,
        default_value: float = 0.0,
        initial_capacity: int = 1024,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.dim = _positive_int("dim", dim)
        self.admit_after = _positive_int("admit_after", admit_after)
        self.ttl = _positive_int("ttl", ttl, allow_none=True)
        self.capacity = _positive_int("capacity", capacity, allow_none=True)
        self.evict_every = _positive_int("evict_every", evict_every)
        _positive_int("initial_capacity", initial_capacity)
        if not dtype.is_floating_point:
            raise ValueError(f"invalid dtype {dtype}; accepted: a floating dtype")
        self.initializer = initializers.resolve(initializer)
        self.default_value = float(default_value)
        device = torch.device(device or "cpu")
        self.index = KeyIndex(int(initial_capacity / _INDEX_LOAD) + 1, device, self._counters())
        self.weight = torch.empty(
            initial_capacity, self.dim, dtype=dtype, device=device
        )  # not a Parameter: DDP leaves it alone
        self.row_state: dict[str, torch.Tensor] = {}
        self._state_init: dict[str, float] = {}
        self.scalars: dict[str, float] = {}  # optimizer counters, e.g. Adam's step
        self._free = torch.empty(0, dtype=torch.int64, device=device)
        self._next_row = 0
        self.step = 0  # advanced by the sparse optimizer at each step; TTL counts these
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, looked-up leaf) awaiting a step
        self._unclaimed_state: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None  # loaded before its optimizer
        self.is_shard = False  # set by ShardedEmbeddingCollection on the shards it holds
        self._checked_job = False

    def _counters(self) -> tuple[str, ...]:
        """Per-key int32 counters the rules need: counts for admission and LFU, last_seen for TTL and LFU."""
        counts = self.admit_after > 1 or self.capacity is not None
        last_seen = self.ttl is not None or self.capacity is not None
        return ("counts",) * counts + ("last_seen",) * last_seen

    def extra_repr(self) -> str:
        extra = "".join(
            f", {k}={getattr(self, k)}" for k in ("admit_after", "ttl", "capacity") if getattr(self, k) not in (None, 1)
        )
        return f"dim={self.dim}, rows={len(self)}{extra}"

    def __len__(self) -> int:
        return self._next_row - self._free.numel()

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def memory_bytes(self) -> int:
        """Bytes held by the index, the rows and their optimizer state."""
        tensors = [self.weight, self._free, *self.row_state.values()]
        return self.index.nbytes() + sum(t.numel() * t.element_size() for t in tensors)

    # -- lookups ---------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` (any shape) -> ids.shape + (dim,); keys without a row read `default_value`."""
        ids = check_keys(ids)
        unique, inverse, counts = torch.unique(ids.reshape(-1), return_inverse=True, return_counts=True)
        return self.rows_for(unique, counts).index_select(0, inverse).reshape(*ids.shape, self.dim)

    def rows_for(self, keys: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of unique int64 `keys` as [n, dim]; a training lookup counts, admits and records them for the step."""
        training = self.training and torch.is_grad_enabled()
        rows = self._admit(keys, counts) if training else self._find_rows(keys)
        values = self.weight.index_select(0, rows.clamp(min=0))
        missing = rows < 0
        if missing.any():
            values[missing] = self.default_value
        if training:
            values.requires_grad_(True)
            self._pending.append((rows, values))
            if len(self._pending) == _PENDING_WARNING:
                warnings.warn(
                    f"{_PENDING_WARNING} training lookups of this DynamicEmbedding "
                    "since the last sparse optimizer step; "
                    "only a sparse optimizer's step() trains and releases them (is one attached?). "
                    "Lookups that should not train belong under eval() or torch.no_grad().",
                    stacklevel=2,
                )
        return values

    def _find_rows(self, keys: torch.Tensor) -> torch.Tensor:
        slot, found = self.index.find(keys)
        return torch.where(found, self.index.rows[slot], -1).to(torch.int64)

    def _admit(self, keys: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        if not self._checked_job:
            self._checked_job = True
            _warn_if_replicated(self)
        index = self.index
        slot, _ = index.lookup_or_insert(keys)
        rows = index.rows[slot].to(torch.int64)
        admit = rows == PENDING
        if "counts" in index.counters:
            seen = index.counters["counts"][slot].to(torch.int64) + (1 if counts is None else counts)
            index.counters["counts"][slot] = seen.clamp(max=_INT32_MAX).to(torch.int32)
            admit &= seen >= self.admit_after
        if "last_seen" in index.counters:
            index.counters["last_seen"][slot] = self.step
        if admit.any():
            new_rows = self._allocate(keys[admit])
            index.rows[slot[admit]] = new_rows.to(torch.int32)
            rows[admit] = new_rows
        return rows

    # -- rows and their state --------------------------------------------------------------

    def _allocate(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows for newly admitted keys (freed rows first), initialized with their optimizer state."""
        n = keys.numel()
        reuse = min(n, self._free.numel())
        fresh = torch.arange(self._next_row, self._next_row + n - reuse, device=self.device)
        rows = torch.cat([self._free[self._free.numel() - reuse :], fresh])
        self._free = self._free[: self._free.numel() - reuse]
        self._next_row += n - reuse
        self._ensure_rows(self._next_row)
        self.weight[rows] = self.initializer(keys, self.dim).to(self.weight.dtype)
        for name, state in self.row_state.items():
            state[rows] = self._state_init[name]
        return rows

    def _ensure_rows(self, needed: int) -> None:
        have = self.weight.shape[0]
        if needed <= have:
            return
        size = max(needed, have + have // 8 + 64)  # 1.125x: little slack at the end, still amortized copies

        def grow(t: torch.Tensor) -> torch.Tensor:
            out = t.new_empty((size, *t.shape[1:]))
            out[:have] = t
            return out

        self.weight = grow(self.weight)
        self.row_state = {name: grow(t) for name, t in self.row_state.items()}

    def add_row_state(self, name: str, width: int, init: float) -> None:
        """Per-row optimizer state of `width` values starting at `init`, moved with the rows."""
        if name in self.row_state:
            if self.row_state[name].shape[1] != width or self._state_init[name] != init:
                raise ValueError(f"row state {name!r} already exists with another shape or initial value")
            return
        self.row_state[name] = torch.full(
            (self.weight.shape[0], width), float(init), dtype=self.weight.dtype, device=self.device
        )
        self._state_init[name] = float(init)
        if self._unclaimed_state is not None and name in self._unclaimed_state[1]:
            keys, states = self._unclaimed_state
            rows = self._find_rows(keys)
            keep = rows >= 0
            self.row_state[name][rows[keep]] = states.pop(name)[keep].to(self.device, self.weight.dtype)

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows trained since the last step (unique, admitted) and their summed gradients; clears the record."""
        rows, grads = [], []
        for r, leaf in self._pending:
            if leaf.grad is not None:
                keep = torch.nonzero(r >= 0).squeeze(1)
                rows.append(r.index_select(0, keep))
                grads.append(leaf.grad.index_select(0, keep))
        self._pending.clear()
        if not rows:
            return torch.empty(0, dtype=torch.int64, device=self.device), self.weight.new_empty(0, self.dim)
        if len(rows) == 1:  # one lookup of unique keys: its rows are distinct already
            return rows[0], grads[0]
        rows_all, grads_all = torch.cat(rows), torch.cat(grads)
        unique, inverse = torch.unique(rows_all, return_inverse=True)
        summed = grads_all.new_zeros(unique.numel(), self.dim).index_add_(0, inverse, grads_all)
        return unique, summed

    def end_step(self) -> None:
        """Advance the table's step clock and apply the eviction rules."""
        self.step += 1
        over_capacity = self.capacity is not None and len(self) > self.capacity
        if over_capacity or (self.ttl is not None and self.step % self.evict_every == 0):
            self.evict()

    def evict(self) -> int:
        """Evict keys unseen for more than `ttl` steps, then the least frequently used above `capacity`."""
        index = self.index
        slots = index.live_slots()
        drop = torch.zeros(slots.shape, dtype=torch.bool, device=slots.device)
        if self.ttl is not None:
            drop |= (self.step - index.counters["last_seen"][slots].to(torch.int64)) > self.ttl
        if self.capacity is not None:
            admitted = (index.rows[slots] >= 0) & ~drop
            excess = int(admitted.sum()) - self.capacity
            if excess > 0:
                candidates = torch.nonzero(admitted).squeeze(1)
                s = slots[candidates]
                # Least frequent first, then least recently seen.
                score = index.counters["counts"][s].to(torch.int64) * (1 << 32) + index.counters["last_seen"][s]
                drop[candidates[torch.topk(score, excess, largest=False).indices]] = True
        evicted = slots[drop]
        self._release(evicted)
        return evicted.numel()

    def _release(self, slots: torch.Tensor) -> None:
        rows = self.index.rows[slots].to(torch.int64)
        self._free = torch.cat([self._free, rows[rows >= 0]])
        self.index.remove(slots)

    # -- export and checkpoints ------------------------------------------------------------

    def keys(self) -> torch.Tensor:
        """The keys that have rows, sorted."""
        slots = torch.nonzero(self.index.rows >= 0).squeeze(1)
        return torch.sort(self.index.keys[slots]).values

    def export(self) -> dict[str, torch.Tensor]:
        """Everything the table knows, ordered by key: rows, optimizer state, counters and pending keys."""
        index = self.index
        out: dict[str, torch.Tensor] = {}
        for prefix, mask in (("", index.rows >= 0), ("pending_", index.rows == PENDING)):
            slots = torch.nonzero(mask).squeeze(1)
            order = torch.argsort(index.keys[slots])
            slots = slots[order]
            out[prefix + "keys"] = index.keys[slots]
            for name, counter in index.counters.items():
                out[prefix + name] = counter[slots]
            if not prefix:
                rows = index.rows[slots].to(torch.int64)
                out["weight"] = self.weight[rows]
                for name, state in self.row_state.items():
                    out[f"state.{name}"] = state[rows]
        out["step"] = torch.tensor(self.step, dtype=torch.int64)
        for name, value in self.scalars.items():
            out[f"scalar.{name}"] = torch.tensor(value, dtype=torch.float64)
        return out

    def load(self, data: dict[str, torch.Tensor]) -> None:
        """Replace the table's contents with an `export()` (or a merge of several, keys unique)."""
        for name in ("keys", "weight"):
            if name not in data:
                raise KeyError(f"embedding table data has no {name!r}")
        keys = check_keys(data["keys"], "keys").to(self.device)
        weight = data["weight"]
        if weight.shape != (keys.numel(), self.dim):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} does not fit {keys.numel()} keys of dim {self.dim}"
            )
        pending = check_keys(data.get("pending_keys", keys[:0]), "pending_keys").to(self.device)
        all_keys = torch.cat([keys, pending])
        if torch.unique(all_keys).numel() != all_keys.numel():
            raise ValueError("embedding table data has repeated keys")
        self.index = KeyIndex(int(max(all_keys.numel(), 1) / _INDEX_LOAD) + 1, self.device, self._counters())
        self._free, self._next_row = self._free[:0], 0
        self._ensure_rows(keys.numel())
        self._pending.clear()
        slot = self.index.insert(all_keys, self.index.find(all_keys)[0])
        n = keys.numel()
        self.index.rows[slot[:n]] = torch.arange(n, dtype=torch.int32, device=self.device)
        self._next_row = n
        for (
            name,
            counter,
        ) in self.index.counters.items():  # counters a table without these rules did not keep start at 0
            n_pending = all_keys.numel() - n
            admitted = data.get(name, torch.zeros(n, dtype=torch.int32))
            counter[slot] = torch.cat(
                [admitted, data.get("pending_" + name, torch.zeros(n_pending, dtype=torch.int32))]
            ).to(self.device, torch.int32)
        self.weight[:n] = weight.to(self.device, self.weight.dtype)
        for name, state in self.row_state.items():
            if f"state.{name}" in data:
                state[:n] = data[f"state.{name}"].to(self.device, state.dtype)
            else:
                state[:n] = self._state_init[name]
        self.step = int(data.get("step", torch.tensor(0)))
        self.scalars = {k.removeprefix("scalar."): float(v) for k, v in data.items() if k.startswith("scalar.")}
        # State of an optimizer not created yet waits for it (see add_row_state).
        unclaimed = {
            k.removeprefix("state."): v
            for k, v in data.items()
            if k.startswith("state.") and k[6:] not in self.row_state
        }
        self._unclaimed_state = (keys, unclaimed) if unclaimed else None

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, value in self.export().items():
            destination[prefix + name] = value

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):  # type: ignore[no-untyped-def]
        ours = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        unknown = [n for n in ours if n not in _NAMES and not n.startswith(("state.", "scalar."))]
        unexpected_keys.extend(prefix + n for n in unknown)
        if "keys" not in ours:
            missing_keys.extend(prefix + n for n in ("keys", "weight"))
            return
        try:
            self.load(ours)
        except (KeyError, ValueError, TypeError) as e:
            error_msgs.append(f"{prefix or 'table'}: {e}")

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        self.weight = fn(self.weight)
        self.row_state = {k: fn(v) for k, v in self.row_state.items()}
        self._free = fn(self._free)
        self.index.apply(fn)
        return super()._apply(fn, recurse)
