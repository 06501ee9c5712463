"""Vectorized int64 hashing and an open-addressing key index built from torch ops.

Every key keeps its own slot (no collisions: keys are compared in full), and each probe round
handles all pending keys at once, so the Python loop runs once per probe distance, not per key.
"""

from __future__ import annotations

import torch


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors (wrapping arithmetic): a bijection that spreads keys."""
    x = x.to(torch.int64)
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def combine(x: torch.Tensor, salt: int | torch.Tensor) -> torch.Tensor:
    """A hash of (x, salt): keys of different tables or features stay apart."""
    return mix64(x + mix64(torch.as_tensor(salt, dtype=torch.int64) + _GOLDEN))


EMPTY, TOMBSTONE, PENDING = -1, -2, -3  # slot states stored in `KeyIndex.rows`; >= 0 is a row


class KeyIndex:
    """Key -> slot by linear probing; per slot the key, its row (or a state) and optional int32 counters.

    `counters` names the per-slot int32 arrays kept (e.g. counts, last_seen): only what the table's
    rules need, since the index is most of a table's overhead.
    """

    def __init__(
        self,
        capacity: int = 1024,
        device: torch.device | str = "cpu",
        counters: tuple[str, ...] = (),
        max_load: float = 0.7,
    ):
        capacity = 1 << max(4, (int(capacity) - 1).bit_length())  # a power of two: slot = hash & (capacity - 1)
        self.max_load = max_load
        self.keys = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.rows = torch.full((capacity,), EMPTY, dtype=torch.int32, device=device)
        self.counters = {name: torch.zeros(capacity, dtype=torch.int32, device=device) for name in counters}
        self.used = 0  # live keys plus tombstones: what lengthens probes
        self.live = 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.rows, *self.counters.values()]

    def apply(self, fn) -> None:  # type: ignore[no-untyped-def]
        """Apply a tensor function (e.g. a device move) to every array."""
        self.keys, self.rows = fn(self.keys), fn(self.rows)
        self.counters = {name: fn(t) for name, t in self.counters.items()}

    @property
    def capacity(self) -> int:
        return self.keys.numel()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For unique `keys`: (slot, found); a key not found gets the empty slot ending its probe."""
        mask = self.capacity - 1
        pos = mix64(keys) & mask
        slot = torch.empty_like(pos)
        found = torch.zeros(keys.shape, dtype=torch.bool, device=keys.device)
        active = torch.arange(keys.numel(), device=keys.device)
        probe_keys = keys
        while active.numel():
            state = self.rows.index_select(0, pos)  # index_select: much faster than advanced indexing on CPU
            hit = (state != EMPTY) & (state != TOMBSTONE) & (self.keys.index_select(0, pos) == probe_keys)
            stop = hit | (state == EMPTY)
            slot[active[stop]] = pos[stop]
            found[active[stop]] = hit[stop]
            go = ~stop
            active, pos, probe_keys = active[go], (pos[go] + 1) & mask, probe_keys[go]
        return slot, found

    def insert(self, keys: torch.Tensor, start: torch.Tensor, state: int = PENDING) -> torch.Tensor:
        """Place unique keys known to be absent, each from the empty slot `find` gave; returns their slots."""
        mask = self.capacity - 1
        slot = torch.empty_like(start)
        active = torch.arange(keys.numel(), device=keys.device)
        pos = start.clone()
        while active.numel():
            free = self.rows[pos] == EMPTY
            # Keys probing to the same empty slot: the lowest index wins it, the others probe on.
            winner = torch.zeros_like(free)
            if free.any():
                fpos, fidx = pos[free], active[free]
                uniq, inverse = torch.unique(fpos, return_inverse=True)
                first = torch.full(uniq.shape, keys.numel(), dtype=torch.int64, device=keys.device)
                first.scatter_reduce_(0, inverse, fidx, reduce="amin")
                winner[free] = fidx == first[inverse]
            won_pos, won = pos[winner], active[winner]
            self.keys[won_pos] = keys[won]
            self.rows[won_pos] = state
            for counter in self.counters.values():
                counter[won_pos] = 0
            slot[won] = won_pos
            go = ~winner
            active, pos = active[go], (pos[go] + 1) & mask
        self.used += keys.numel()
        self.live += keys.numel()
        return slot

    def lookup_or_insert(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of unique `keys`, inserting the absent ones as PENDING; also returns which were new."""
        self.reserve(self.live + keys.numel())
        slot, found = self.find(keys)
        new = ~found
        if new.any():
            slot[new] = self.insert(keys[new], slot[new])
        return slot, new

    def remove(self, slots: torch.Tensor) -> None:
        """Turn live slots into tombstones (probes pass over them; `rebuild` clears them)."""
        self.rows[slots] = TOMBSTONE
        self.live -= slots.numel()

    def live_slots(self) -> torch.Tensor:
        return torch.nonzero((self.rows >= 0) | (self.rows == PENDING)).squeeze(1)

    def reserve(self, live: int) -> None:
        """Make room for `live` keys under the load limit, growing or clearing tombstones."""
        extra = max(0, live - self.live)
        if self.used + extra <= self.max_load * self.capacity:
            return
        capacity = self.capacity
        while live > capacity / 2:  # rebuilt at most half full, so growth stays amortized
            capacity *= 2
        self.rebuild(capacity)

    def rebuild(self, capacity: int) -> None:
        """Reinsert the live keys into `capacity` slots; tombstones go."""
        slots = self.live_slots()
        fresh = KeyIndex(capacity, self.keys.device, tuple(self.counters), self.max_load)
        keys = self.keys[slots]
        new_slots = fresh.insert(keys, fresh.find(keys)[0])
        fresh.rows[new_slots] = self.rows[slots]
        for name, counter in self.counters.items():
            fresh.counters[name][new_slots] = counter[slots]
        self.keys, self.rows, self.counters = fresh.keys, fresh.rows, fresh.counters
        self.used = self.live = fresh.live
