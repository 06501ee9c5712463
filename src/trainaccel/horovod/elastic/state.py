"""Elastic state: what `hvd.elastic.run` keeps in memory and, at each commit, on disk.

torchrun restarts every worker after a failure, so memory does not survive it. Each commit is
therefore also written to one file per worker, and a restarted job continues from the newest
commit that any worker holds.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import socket
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from trainaccel.config import env_setting
from trainaccel.horovod.basics import local_rank, size
from trainaccel.horovod.elastic.sampler import ElasticSampler
from trainaccel.horovod.ops import broadcast_object
from trainaccel.horovod.optimizer import broadcast_optimizer_state, broadcast_parameters

log = logging.getLogger("trainaccel")

_TRACKED = (torch.nn.Module, torch.optim.Optimizer, ElasticSampler)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def state_dir() -> Path | None:
    """Where commits go: $TRAINACCEL_ELASTIC_DIR, else one folder per torchrun job in the temp dir.

    None without a launcher: nothing would restart the process, so commits stay in memory.
    """
    explicit = env_setting("elastic_dir")
    if explicit:
        return Path(explicit)
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if job in ("", "none"):
        # "none" is torchrun's default --rdzv-id; the master port then tells jobs on a host apart.
        port = os.environ.get("MASTER_PORT")
        if not port:
            return None
        job = f"port{port}"
    return Path(tempfile.gettempdir()) / f"trainaccel-elastic-{_safe(job)}"


class State:
    """Base of the elastic states: commit, restore and sync, and callbacks for world-size changes."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self._commits = 0  # the same count on every worker, carried across restarts by the files
        self._root = 0  # the worker that sync() copies from
        self._file: Path | None = None

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call these when the world size changed, before the state is synced (e.g. to rescale the learning rate)."""
        callbacks = list(callbacks)
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(f"reset callback {callback!r} is not callable")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory and in this worker's file. A collective: call it on every worker."""
        self.save()
        self._commits += 1
        self._write()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Nothing to check: torchrun's agent watches the membership and restarts every worker on a change."""

    def save(self) -> None:
        """Keep a copy of the current state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last saved copy, undoing changes made since."""
        raise NotImplementedError

    def sync(self) -> None:
        """Give every worker the state of the root worker (rank 0, or after a restart the newest commit's)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a change of world size, before the reset callbacks and the sync."""

    def _payload(self) -> dict[str, Any] | None:
        """What a commit writes to disk; None (a custom State) keeps commits in memory only."""
        return None

    def _load(self, payload: dict[str, Any]) -> None:
        pass

    def _path(self) -> Path | None:
        if self._file is None:
            folder = state_dir()
            if folder is None:
                return None
            # Host and local rank: a restarted worker on this host finds the file of its predecessor.
            local = os.environ.get("LOCAL_RANK") or str(local_rank())
            self._file = folder / f"{_safe(socket.gethostname())}-local{local}.pt"
        return self._file

    def _write(self) -> None:
        payload = self._payload()
        path = self._path() if payload is not None else None
        if path is None:
            return
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        # Written aside, then renamed: a worker killed mid-write leaves the previous commit whole.
        torch.save({"commit": self._commits, "size": size(), "state": payload}, temporary)
        os.replace(temporary, path)

    def _read(self) -> dict[str, Any] | None:
        path = self._path()
        if path is None or not path.exists():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            # Attributes of other types need full unpickling; the file was written by this job.
            return torch.load(path, map_location="cpu", weights_only=False)


class ObjectState(State):
    """State of plain picklable values, given as keyword arguments and read as attributes (`state.epoch`)."""

    def __init__(self, bcast_object: Any = None, get_rank: Any = None, **kwargs: Any):
        # Horovod's ObjectState takes its broadcast and rank functions; trainaccel uses its own.
        super().__init__()
        _check_names(type(self), kwargs)
        self._saved = copy.deepcopy(kwargs)
        self._set_attrs()

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._saved}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved:
            values = broadcast_object({name: getattr(self, name) for name in self._saved}, root_rank=self._root)
            for name, value in values.items():
                setattr(self, name, value)
        self.save()  # the synced state is every worker's committed copy

    def _set_attrs(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))  # later in-place changes must not reach the copy

    def _payload(self) -> dict[str, Any]:
        return {"objects": self._saved}

    def _load(self, payload: dict[str, Any]) -> None:
        self._saved = {**self._saved, **payload["objects"]}  # a value new in the script keeps its start value
        self.restore()


class TorchState(ObjectState):
    """State of a PyTorch job: models, optimizers and ElasticSamplers (through their state_dict), and plain values."""

    def __init__(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any
    ):
        kwargs.update(model=model, optimizer=optimizer)
        _check_names(type(self), kwargs)
        tracked = {name: value for name, value in kwargs.items() if isinstance(value, _TRACKED)}
        object.__setattr__(self, "_tracked", tracked)
        object.__setattr__(self, "_copies", {})
        super().__init__(**{name: value for name, value in kwargs.items() if name not in tracked})
        for name, value in tracked.items():
            object.__setattr__(self, name, value)
        self._save_tracked()

    def __setattr__(self, name: str, value: Any) -> None:
        tracked = self.__dict__.get("_tracked")
        if tracked is not None and name in tracked:
            if not isinstance(value, _TRACKED):
                raise TypeError(
                    f"state.{name} must stay a module, optimizer or ElasticSampler, got {type(value).__name__}"
                )
            tracked[name] = value
            self._copies[name] = copy.deepcopy(value.state_dict())
        object.__setattr__(self, name, value)

    def commit(self) -> None:
        for value in self._tracked.values():
            if isinstance(value, ElasticSampler):
                value._gather_processed()  # each worker recorded only its own batches
        super().commit()

    def save(self) -> None:
        self._save_tracked()
        super().save()

    def restore(self) -> None:
        for name, value in self._tracked.items():
            # A copy: load_state_dict may keep the tensors it is given, which training then changes.
            value.load_state_dict(copy.deepcopy(self._copies[name]))
        super().restore()

    def sync(self) -> None:
        for value in self._tracked.values():
            if isinstance(value, torch.nn.Module):
                broadcast_parameters(value.state_dict(), root_rank=self._root)
            elif isinstance(value, torch.optim.Optimizer):
                broadcast_optimizer_state(value, root_rank=self._root)
            else:
                value._sync(self._root)  # then reset(): re-partitioned over the current workers
        super().sync()

    def _save_tracked(self) -> None:
        self._copies = {name: copy.deepcopy(value.state_dict()) for name, value in self._tracked.items()}

    def _payload(self) -> dict[str, Any]:
        return {**super()._payload(), "tracked": self._copies}

    def _load(self, payload: dict[str, Any]) -> None:
        if set(payload["tracked"]) != set(self._tracked):
            raise ValueError(
                f"the commit file holds state for {sorted(payload['tracked'])}, but this TorchState "
                f"tracks {sorted(self._tracked)}; delete {self._file} to start afresh"
            )
        self._copies = payload["tracked"]
        super()._load(payload)


def _check_names(cls: type, values: dict[str, Any]) -> None:
    bad = sorted(name for name in values if name.startswith("_") or hasattr(cls, name))
    if bad:
        raise ValueError(
            f"invalid state attribute name(s) {bad}: a name must not start with '_' or be a method of {cls.__name__}"
        )
