"""A Chrome-trace timeline (Perfetto, chrome://tracing) of training steps and of each bucket's communication.

One process-wide timeline, opened by `trainaccel.init(timeline=PATH)` or `TRAINACCEL_TIMELINE=PATH`
on rank 0 (on every rank when PATH contains `{rank}`). Events are streamed as a JSON array, one per
line, and flushed at every step; `close()` (run at exit) ends the array. A file cut short by a crash
lacks only the closing bracket, which both viewers accept.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trainaccel import context

STEPS_TRACK = "steps"

_current: Timeline | None = None


class Timeline:
    """Complete ("X") events on named tracks; times are `time.perf_counter()` seconds."""

    def __init__(self, path: str | os.PathLike, rank: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w")
        self._file.write("[\n")
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._tracks: dict[str, int] = {}
        self._events = 0
        self._origin = time.perf_counter()
        self.pid = rank
        self._add({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        self._track(STEPS_TRACK)  # the first track shown

    def span(self, name: str, start: float, end: float, track: str, category: str = "comm", **args: Any) -> None:
        """Record `name` from `start` to `end` on `track` (thread-safe; written at the next flush)."""
        event = {
            "name": name,
            "cat": category,
            "ph": "X",
            "pid": self.pid,
            "tid": self._track(track),
            "ts": round((start - self._origin) * 1e6, 3),
            "dur": round(max(0.0, end - start) * 1e6, 3),
        }
        if args:
            event["args"] = args
        self._add(event)

    def flush(self) -> None:
        """Write the events recorded so far."""
        with self._lock:
            pending, self._pending = self._pending, []
            if self._file is None or not pending:
                return
            lines = []
            for event in pending:
                lines.append(("" if self._events == 0 else ",\n") + json.dumps(event, separators=(",", ":")))
                self._events += 1
            self._file.write("".join(lines))
            self._file.flush()

    def close(self) -> None:
        """Write what is left and end the JSON array; later events are dropped."""
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None

    def _track(self, name: str) -> int:
        tid = self._tracks.get(name)
        if tid is None:
            with self._lock:
                if name not in self._tracks:
                    tid = self._tracks[name] = len(self._tracks) + 1
                    # Tracks sort by this index: steps first, then buckets in order of first use.
                    self._pending.append(
                        {"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": name}}
                    )
                    self._pending.append(
                        {
                            "name": "thread_sort_index",
                            "ph": "M",
                            "pid": self.pid,
                            "tid": tid,
                            "args": {"sort_index": tid},
                        }
                    )
                tid = self._tracks[name]
        return tid

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(event)


def bucket_track(key: Any) -> str:
    """The track of a bucket (`3`) or of one chunk of it (`(3, 1)`): one per piece, so spans nest."""
    if isinstance(key, tuple):
        index, chunk = key
        return f"bucket {index}" if chunk == 0 else f"bucket {index}.{chunk}"
    return f"bucket {key}"


def traced(name: str, key: Any, stage: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`stage`, recorded as a span on `key`'s bucket track when a timeline is open."""

    def run(value: Any) -> Any:
        trace = current()
        if trace is None:
            return stage(value)
        start = time.perf_counter()
        try:
            return stage(value)
        finally:
            trace.span(name, start, time.perf_counter(), bucket_track(key))

    return run


def current() -> Timeline | None:
    """The timeline being written in this process, or None."""
    return _current


def start(path: str | os.PathLike, rank: int) -> Timeline | None:
    """Open the process-wide timeline for `path` if this rank writes one (idempotent); returns it or None."""
    global _current
    text = os.fspath(path)
    if "{rank}" in text:
        text = text.replace("{rank}", str(rank))
    elif rank != 0:
        return None
    if _current is not None:
        if _current.path == Path(text):
            return _current
        _current.close()
    _current = Timeline(text, rank)
    if context.first_time("timeline"):
        context.on_undo("timeline", stop)  # shutdown() closes it, as the end of the process would
    return _current


@atexit.register
def stop() -> None:
    """Close the process-wide timeline, if any."""
    global _current
    if _current is not None:
        _current.close()
        _current = None
