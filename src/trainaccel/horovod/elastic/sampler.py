"""`ElasticSampler`: a DistributedSampler that remembers which samples the epoch has processed.

After a restart or a change of world size, `reset()` deals the samples not yet processed this
epoch out to the current workers, so each sample is seen once per epoch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
import torch.utils.data

from trainaccel.horovod.basics import rank, size
from trainaccel.horovod.ops import allgather_object


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset over the workers and re-partitions what is left after a reset.

    Put it in the `TorchState`, call `record_batch` after each batch and `set_epoch` at the end
    of each epoch. `seed` must be the same on every worker.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0):
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"ElasticSampler needs a dataset with a length, got {type(dataset).__name__}")
        if not isinstance(shuffle, bool):
            raise TypeError(f"invalid shuffle={shuffle!r}: expected True or False")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"invalid seed={seed!r} ({type(seed).__name__}): expected an int")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        # Indices recorded here since the workers last pooled them (see `_gather_processed`).
        self._unshared: set[int] = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch`: forget the processed indices and deal the whole dataset out again.

        Call it at the end of an epoch (with the next epoch's number), so a restart in the
        middle of an epoch does not process its samples twice.
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise TypeError(f"invalid epoch={epoch!r} ({type(epoch).__name__}): expected an int")
        self.epoch = epoch
        self.processed_indices = set()
        self._unshared = set()
        self.reset()

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The indices of batch `batch_idx` of this worker's current partition."""
        if batch_idx < 0 or batch_size < 1:
            raise ValueError(f"invalid batch_idx={batch_idx} or batch_size={batch_size}")
        start = batch_idx * batch_size
        return self.indices[start : start + batch_size]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch `batch_idx` (counted from the last reset) as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark these dataset indices as processed."""
        new = {int(i) for i in indices}
        self.processed_indices |= new
        self._unshared |= new

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take `state_dict()`'s epoch and processed indices, then `reset()`."""
        missing = {"epoch", "processed_indices"} - set(state_dict)
        if missing:
            raise KeyError(f"ElasticSampler state_dict lacks {sorted(missing)}; it has {sorted(state_dict)}")
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self._unshared = set()
        self.reset()

    def reset(self) -> None:
        """Deal the samples not processed this epoch out over the current `hvd.size()` workers."""
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            # Shuffle the whole epoch, then drop what is done: the order of the rest is the
            # order an uninterrupted epoch would have used.
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(order), generator=generator).tolist()
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:
            # Repeat from the start, as DistributedSampler does, so every worker gets as many.
            padded += padded[: self.total_size - len(padded)]
        self.indices = padded[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples

    def _gather_processed(self) -> None:
        """Pool every worker's newly processed indices (a collective), so any one commit has them all."""
        for part in allgather_object(self._unshared):
            self.processed_indices |= part
        self._unshared = set()

    def _sync(self, root_rank: int) -> None:
        """Take the root's epoch and the processed indices of that epoch from every worker, then reset."""
        everyone = allgather_object((self.epoch, self.processed_indices))
        epoch = everyone[root_rank][0]
        # A worker still in another epoch (restored from an older commit) must not add its indices.
        processed = set().union(*(done for e, done in everyone if e == epoch))
        self.load_state_dict({"epoch": epoch, "processed_indices": processed})
