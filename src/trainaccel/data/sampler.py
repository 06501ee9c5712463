"""`ShardSampler`: each rank a disjoint, equal part of the dataset, shuffled with shard locality, resumable."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainaccel.data.dataset import RecordDataset


class ShardSampler(torch.utils.data.Sampler[int]):
    """Deterministic from `seed` and the epoch: shuffle the shards, then records within windows.

    Reading shard after shard keeps file reads local (quasi-random order, as a shuffle buffer
    gives). Every rank gets an equal, contiguous part of the epoch's order; with `drop_last=False`
    the order is padded with its own start so all parts are equal. `state_dict(consumed)` and
    `load_state_dict` resume an epoch with exactly the samples not yet consumed.
    """

    def __init__(
        self,
        dataset: RecordDataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        window: int = 1024,
        drop_last: bool = False,
    ):
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if (
            not isinstance(num_replicas, int)
            or num_replicas < 1
            or not isinstance(rank, int)
            or not 0 <= rank < num_replicas
        ):
            raise ValueError(
                f"invalid rank={rank!r} of num_replicas={num_replicas!r}; accepted: 0 <= rank < num_replicas"
            )
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"invalid window={window!r}; accepted: an integer >= 1 (records shuffled together)")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.window, self.drop_last = shuffle, seed, window, drop_last
        self.epoch = 0
        self._part: tuple[tuple[int, int], list[int]] | None = None  # ((epoch, seed), this rank's part)
        self._start = 0  # samples of this epoch's part already consumed (after load_state_dict)
        self._yielded = 0
        total = len(dataset)
        self.num_samples = total // num_replicas if drop_last else -(-total // num_replicas)
        self._announce()

    def order(self) -> list[int]:
        """The whole epoch's order, before it is split over the ranks."""
        ranges = self.dataset.shard_ranges()
        if not self.shuffle:
            return [i for start, end in ranges for i in range(start, end)]
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        shards = torch.randperm(len(ranges), generator=generator).tolist()
        order = [i for s in shards for i in range(*ranges[s])]
        for start in range(0, len(order), self.window):
            block = order[start : start + self.window]
            order[start : start + self.window] = [
                block[j] for j in torch.randperm(len(block), generator=generator).tolist()
            ]
        return order

    def part(self) -> list[int]:
        """This rank's part of the epoch, from its start (ignoring a resume point)."""
        if self._part is not None and self._part[0] == (self.epoch, self.seed):
            return self._part[1]
        order = self.order()
        size = self.num_samples * self.num_replicas
        if size > len(order):
            order += (order * (-(-size // max(len(order), 1))))[: size - len(order)]
        part = order[self.rank * self.num_samples : (self.rank + 1) * self.num_samples]
        self._part = ((self.epoch, self.seed), part)
        return part

    def _announce(self) -> None:
        """Tell the dataset the order this rank reads the epoch in, so that remote shards are read ahead.

        Loader workers started after this (at `iter(loader)`) know it; persistent workers keep the
        order they started with, which costs read-ahead bandwidth in later epochs, never correctness.
        """
        if getattr(self.dataset, "store", None) is not None:  # remote shards; local ones need no plan
            self.dataset.plan_reads(self.part()[self._start :])

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0  # a resume point holds for one pass
        self._yielded = start
        for index in self.part()[start:]:
            self._yielded += 1
            yield index

    def __len__(self) -> int:
        return self.num_samples - self._start

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._announce()

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where to resume: after `consumed` samples of this rank's part (default: as many as were yielded).

        A DataLoader fetches ahead of the training loop, so pass what the loop has used.
        """
        consumed = self._yielded if consumed is None else consumed
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(f"invalid consumed={consumed}; accepted: 0 to {self.num_samples} (this rank's part)")
        return {"epoch": self.epoch, "seed": self.seed, "consumed": consumed, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed or state["num_replicas"] != self.num_replicas:
            raise ValueError(
                f"this state is for seed {state['seed']} on {state['num_replicas']} ranks; "
                f"the sampler has seed {self.seed} on {self.num_replicas}"
            )
        self.epoch, self._start = state["epoch"], state["consumed"]
        self._announce()
