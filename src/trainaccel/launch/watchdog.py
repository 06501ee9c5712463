"""`trainaccel run`'s watchdog: it ends a local worker whose heartbeat stopped for longer than the worker's limit.

A worker's own heartbeat thread ends it when the job is over; a worker that cannot run Python at all
(SIGSTOP, a C call holding the interpreter) cannot. Each worker also writes its heartbeat, with its
limit (hang_timeout once warm, else collective_timeout, plus a margin), to a file in a folder that
`trainaccel run` gives it; past the limit the watchdog kills it, and torchrun handles the exit as
any failure (the job ends, or restarts with --max-restarts).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from trainaccel.config import Config

CHECK_S = 1.0


class Watchdog:
    """Context manager: creates the heartbeat folder, exports it to the workers, and checks it every second."""

    def __init__(self, interval_s: float = CHECK_S):
        self._interval = interval_s
        self.folder: Path | None = None
        self.ended: list[str] = []  # one line per worker ended
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._env = Config.env_name("heartbeat_dir")
        self._previous: str | None = None

    def __enter__(self) -> Watchdog:
        self.folder = Path(tempfile.mkdtemp(prefix="trainaccel-heartbeats-"))
        self._previous = os.environ.get(self._env)
        os.environ[self._env] = str(self.folder)  # torchrun's workers inherit this process's environment
        self._thread = threading.Thread(target=self._run, name="trainaccel-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self._interval)
        if self._previous is None:
            os.environ.pop(self._env, None)
        else:
            os.environ[self._env] = self._previous
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.check()

    def check(self, now: float | None = None) -> list[str]:
        """Kill every child worker whose heartbeat is older than its limit; returns what was said about each."""
        said = []
        for path in sorted(self.folder.glob("*.json")) if self.folder is not None else []:
            try:
                beat = json.loads(path.read_text())
                pid, written, limit = int(beat["pid"]), float(beat["time"]), float(beat["limit_s"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced, or a stranger's file: nothing to act on
            age = (time.time() if now is None else now) - written
            if age <= limit or not _is_child(pid):
                continue
            line = (
                f"trainaccel run: ended local rank {path.stem} (rank {beat.get('rank', '?')}, pid {pid}): no heartbeat "
                f"for {age:.0f} s, past its limit of {limit:.0f} s: it is stopped, or stuck outside Python"
            )
            try:
                os.kill(pid, signal.SIGKILL)  # a stopped process takes SIGKILL; SIGTERM would wait for SIGCONT
            except ProcessLookupError:
                continue
            path.unlink(missing_ok=True)
            print(line, file=sys.stderr, flush=True)
            said.append(line)
        self.ended += said
        return said


def process_stat(pid: int) -> tuple[str, int, str] | None:
    """(state, parent pid, start time) of a process from /proc, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return fields[0], int(fields[1]), fields[19]


def _is_child(pid: int) -> bool:
    """Whether `pid` is a live child of this process (its workers are; a reused pid is not)."""
    stat = process_stat(pid)
    return stat is not None and stat[0] != "Z" and stat[1] == os.getpid()
