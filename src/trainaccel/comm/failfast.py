"""Fail fast: a collective timeout well under torch's 30 minutes, and an error that says which peer is missing.

Every worker with trainaccel's hook writes a heartbeat (time and training step) to the job's
store every few seconds. When a collective fails, `explain()` reads them: a peer whose heartbeat
stopped is gone or frozen; a peer at an earlier step has not reached the collective.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainaccel import context
from trainaccel.environment import worker_place
from trainaccel.observer import process_step

log = logging.getLogger("trainaccel")

HEARTBEAT_S = 2.0
_PREFIX = "trainaccel/heartbeat/"

_heartbeat: Heartbeat | None = None
_reports: dict[str, Callable[[], Any]] = {}  # extra heartbeat fields: name -> what to write


def set_collective_timeout(seconds: float) -> None:
    """Process groups created from now on without an explicit timeout get `seconds` (any backend), until shutdown."""

    def default_timeout(backend: object) -> timedelta:
        return timedelta(seconds=seconds)

    # torch reads its default through this function for init_process_group, new_group and the rest.
    if context.first_time("collective timeout"):
        context.patch(distributed_c10d, "_get_default_timeout", default_timeout)
    else:  # a later init(): the first patch still holds torch's own function for shutdown() to restore
        distributed_c10d._get_default_timeout = default_timeout


class Heartbeat:
    """A daemon thread writing this worker's time, host, local rank and step to the store."""

    def __init__(self, progress: Callable[[], int] = process_step, interval_s: float = HEARTBEAT_S):
        self.rank, self.world = dist.get_rank(), dist.group.WORLD
        self._store = distributed_c10d._get_default_store().clone()  # its own connection: no lock with the main thread
        self._progress, self._interval = progress, interval_s
        host, local_rank = worker_place()
        self._place = {"host": host, "local_rank": local_rank}
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="trainaccel-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        extra = {name: value() for name, value in list(_reports.items())}
        beat = {**self._place, "time": time.time(), "step": self._progress(), **extra}
        self._store.set(f"{_PREFIX}{self.rank}", json.dumps(beat))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except Exception:  # the store went away: the job is ending
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval)


def start_heartbeat() -> None:
    """Start this process's heartbeat for the current default group (call after it is up); idempotent."""
    global _heartbeat
    if not dist.is_initialized() or (_heartbeat is not None and _heartbeat.world is dist.group.WORLD):
        return
    stop_heartbeat()  # an earlier group's (elastic jobs start new ones)
    if context.first_time("heartbeat"):
        context.on_undo("heartbeat", stop_heartbeat)
    try:
        _heartbeat = Heartbeat()
    except Exception as e:  # a store without clone or writes: training goes on, failures are not explained
        log.debug("no heartbeat (%s: %s): collective failures will not name the missing peers", type(e).__name__, e)


def report(name: str, value: Callable[[], Any]) -> Callable[[], None]:
    """Write `name: value()` (JSON) in this worker's heartbeats from now on; returns what stops it."""
    _reports[name] = value

    def stop() -> None:
        if _reports.get(name) is value:
            del _reports[name]

    return stop


def heartbeats() -> dict[int, dict] | None:
    """Every worker's latest heartbeat by rank (read now, from the main thread); None without a heartbeat."""
    if _heartbeat is None:
        return None
    return _read_heartbeats(distributed_c10d._get_default_store(), dist.get_world_size())


@atexit.register
def stop_heartbeat() -> None:
    """Stop the heartbeat thread before the interpreter finalizes (a thread in a store call would abort it)."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


def looks_like_collective_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        word in text for word in ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")
    )


def explain(error: BaseException) -> str | None:
    """Which peers a failed collective was missing, from their heartbeats; None if this is no such failure.

    Waits one and a half heartbeats to see which peers still beat.
    """
    if _heartbeat is None or not looks_like_collective_failure(error):
        return None
    me, mine = _heartbeat.rank, _heartbeat._progress()
    try:
        world = dist.get_world_size()
        before = _read_heartbeats(_heartbeat._store, world)
        time.sleep(1.5 * _heartbeat._interval)
        after = _read_heartbeats(_heartbeat._store, world)
    except Exception as e:  # the store is gone too: the job's first host is down
        return f"a collective failed on rank {me}; the job's store cannot be reached either ({e})"
    missing = []
    for rank in range(world):
        beat = after.get(rank)
        if rank == me:
            continue
        if beat is None:
            missing.append(f"rank {rank}: no heartbeat ever (it never got as far as training)")
            continue
        where = f"rank {rank} (host {beat['host']}, local rank {beat['local_rank']})"
        if before.get(rank, {}).get("time") == beat["time"]:
            missing.append(
                f"{where}: no heartbeat for {time.time() - beat['time']:.0f} s, its process is gone or frozen"
            )
        elif beat["step"] < mine:
            missing.append(
                f"{where}: alive but at step {beat['step']}, behind this rank's step {mine}: "
                "it has not reached this collective"
            )
    if not missing:
        return f"a collective failed on rank {me} at step {mine}; every peer is alive and at least as far"
    return f"a collective failed on rank {me} at step {mine}; missing peers: " + "; ".join(missing)


def annotate(error: BaseException) -> None:
    """Add `explain(error)` to the error's notes (shown with its traceback), once."""
    if any(note.startswith("trainaccel: ") for note in getattr(error, "__notes__", ())):
        return
    note = explain(error)
    if note is not None:
        error.add_note(f"trainaccel: {note}")


def _read_heartbeats(store: dist.Store, world: int) -> dict[int, dict]:
    keys = {rank: f"{_PREFIX}{rank}" for rank in range(world)}
    return {rank: json.loads(store.get(key)) for rank, key in keys.items() if store.check([key])}
