"""`trainaccel run`'s watchdog: it ends a local worker whose heartbeat stopped for longer than the worker's limit.

A worker's own heartbeat thread ends it when the job is over; a worker that cannot run Python at all
(SIGSTOP, a C call holding the interpreter) cannot. Each worker also writes its heartbeat, with its
limit (hang_timeout once warm, else collective_timeout, plus a margin), to a file in a folder that
`trainaccel run` gives it; past the limit the watchdog kills it, and torchrun handles the exit as
any failure (the job ends, or restarts with --max-restarts).

A worker that dies without a word (a signal: SIGABRT from NCCL's watchdog on a collective timeout,
SIGSEGV, ...; or a non-zero exit outside Python) leaves its heartbeat file behind; a worker that ends
having said why removes it. The watchdog then publishes the failure for it in the job's store, as the
worker would have, so that every node's workers end at once naming it.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from trainaccel.config import Config

CHECK_S = 1.0
STORE_CONNECT_S = 5.0  # how long publishing waits for the job's store to accept a connection
PUBLISH_S = STORE_CONNECT_S + 10.0  # connecting, publishing, and waiting for the peers to read it: at most this
# Ended from outside on purpose (torchrun's agent stopping the others, the user): no failure of the worker's own.
STOPPING_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}


class Watchdog:
    """Context manager: creates the heartbeat folder, exports it to the workers, and checks it every second."""

    def __init__(self, interval_s: float = CHECK_S):
        self._interval = interval_s
        self.folder: Path | None = None
        self.ended: list[str] = []  # one line per worker ended
        self.published: list[dict] = []  # the failures published for workers that died without a word
        self._workers: dict[int, int | None] = {}  # pid of each child -> its pidfd
        self._killed: dict[int, tuple[str, dict]] = {}  # pid -> why the watchdog killed it, and its last heartbeat
        self._statuses: dict[int, os.waitid_result] = {}  # pid -> how it ended, read on SIGCHLD
        self._done: set[int] = set()  # ended children already dealt with
        self._unread: set[int] = set()  # of those, the ones reaped by torchrun's agent before their status was read
        self._previous_sigchld: object = None
        self._wake_read, self._wake_write = os.pipe()
        for fd in (self._wake_read, self._wake_write):
            os.set_blocking(fd, False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._env = Config.env_name("heartbeat_dir")
        self._previous: str | None = None

    def __enter__(self) -> Watchdog:
        self.folder = Path(tempfile.mkdtemp(prefix="trainaccel-heartbeats-"))
        self._previous = os.environ.get(self._env)
        os.environ[self._env] = str(self.folder)  # torchrun's workers inherit this process's environment
        if threading.current_thread() is threading.main_thread():
            self._previous_sigchld = signal.signal(signal.SIGCHLD, self._on_child_exit)
        self._thread = threading.Thread(target=self._run, name="trainaccel-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # torchrun's agent has returned, but its store still runs (its frames are alive until this returns): a
        # failure being published for a dead worker gets there, and the peers get to read it.
        if self._previous_sigchld is not None:
            signal.signal(signal.SIGCHLD, self._previous_sigchld)  # type: ignore[arg-type]
            self._previous_sigchld = None
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5 * self._interval + PUBLISH_S)
        for fd in self._workers.values():
            if fd is not None:
                os.close(fd)
        os.close(self._wake_read)
        os.close(self._wake_write)
        if self._previous is None:
            os.environ.pop(self._env, None)
        else:
            os.environ[self._env] = self._previous
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _run(self) -> None:
        # Each worker's pidfd wakes this thread the moment it dies, while it is still a zombie whose exit status
        # can be read without reaping it: torchrun's agent reaps it at its next check (every 0.1 s).
        next_check = time.monotonic() + self._interval
        while not self._stop.is_set():
            poller = select.poll()
            poller.register(self._wake_read, select.POLLIN)
            for fd in self._workers.values():
                if fd is not None:
                    poller.register(fd, select.POLLIN)
            poller.poll(max(0.0, next_check - time.monotonic()) * 1000)
            if self._stop.is_set():
                break
            try:
                os.read(self._wake_read, 4096)
            except BlockingIOError:
                pass
            self.collect()
            if time.monotonic() >= next_check:
                self.check()
                self.watch_children()
                self.collect()  # workers without a pidfd, and those that died meanwhile
                next_check = time.monotonic() + self._interval
        # Once more, stopping: a worker whose status the SIGCHLD handler read just before torchrun's agent returned
        # is published still (the agent returns within milliseconds of reaping its last worker).
        self.collect()

    def _on_child_exit(self, signum: int, frame: object) -> None:
        # Python runs this on the main thread, where torchrun's agent reaps its workers between its checks: here,
        # before the agent's next check, each ended worker's status is read (and left to the agent to reap).
        # The pidfds alone would race the agent's check by the few milliseconds this process takes to wake.
        for pid in _children():
            if pid in self._done or pid in self._statuses:
                continue
            try:
                status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue
            if status is not None:
                self._statuses[pid] = status
        self._wake()  # publishing takes the store's time: the watchdog's thread does it
        if callable(self._previous_sigchld):
            self._previous_sigchld(signum, frame)

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:
            pass  # woken already

    def watch_children(self) -> None:
        """Start watching each new child (a worker), from its start: it may die before its first heartbeat is read."""
        for pid in _children():
            if pid not in self._workers and _is_child(pid):  # alive: a pid used again is a new worker
                self._done.discard(pid)
                self._workers[pid] = _pidfd(pid)

    def collect(self) -> list[dict]:
        """Publish a failure for each known worker that died without a word; returns the failures published."""
        published = []
        for pid in {*self._workers, *self._statuses} - self._done:
            status = self._statuses.pop(pid, None)
            if status is None:
                try:
                    status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # read, left to reap
                except ChildProcessError:
                    status = None  # reaped already (torchrun's agent was first): how it ended is unknown
                    self._unread.add(pid)
                else:
                    if status is None:
                        continue  # alive
            fd = self._workers.pop(pid, None)
            if fd is not None:
                os.close(fd)
            self._done.add(pid)
            killed = pid in self._killed
            if killed:  # said already, and its file removed
                reason, beat = self._killed.pop(pid)
            else:
                # A heartbeat file left behind: it ended without saying why (a worker that did removed it).
                beat = self._left_behind(pid)
                reason = death_reason(status, beat) if beat is not None else None
            if reason is None:
                continue  # it ended having said why, cleanly, stopped from outside, or before training
            failure = publish_death(pid, beat, reason, announce=not killed)
            if failure is not None:
                published.append(failure)
        self.published += published
        return published

    def reaped(self, exit_codes: dict[int, int]) -> None:
        """How the workers torchrun's agent reports failed ended ({pid: exit code, minus the signal's number for a
        signal}): those it reaped before this watchdog read their status are published now, as `collect` would have.

        The SIGCHLD handler runs at the main thread's next bytecode; a worker that dies just before the agent's
        `waitpid` call is reaped unseen. torchrun's `ChildFailedError` keeps each failed worker's pid and exit code.
        """
        for pid, code in exit_codes.items():
            if pid in self._done and pid not in self._unread:
                continue  # its status was read: said and published already, or no failure of its own
            self._unread.discard(pid)
            self._done.discard(pid)
            killed = (pid, 0, signal.SIGCHLD, -code, os.CLD_KILLED) if code < 0 else None
            self._statuses[pid] = os.waitid_result(killed or (pid, 0, signal.SIGCHLD, code, os.CLD_EXITED))
        self._wake()

    def _left_behind(self, pid: int) -> dict | None:
        """The heartbeat file that the ended worker `pid` left behind, read; None if it has none."""
        for path in self.folder.glob("*.json") if self.folder is not None else []:
            try:
                beat = json.loads(path.read_text())
                if int(beat["pid"]) == pid:
                    return beat
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return None

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
            self._killed[pid] = (f"ended by its node's trainaccel run: {line.split(': ', 2)[2]}", beat)
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


def death_reason(status: os.waitid_result | None, beat: dict) -> str | None:
    """Why a worker's process ended, from its exit status, as its failure says; None: no failure of its own."""
    if status is None:  # unknown: a script may end itself with os._exit(0)
        return None
    if status.si_code == os.CLD_EXITED:
        if status.si_status == 0:
            return None
        return f"its process exited with status {status.si_status} without a Python error"
    number = status.si_status
    try:
        sig = signal.Signals(number)
    except ValueError:
        return f"its process was ended by signal {number} without a Python error"
    if sig in STOPPING_SIGNALS:
        return None
    text = f"its process was ended by {sig.name} (signal {number}) without a Python error"
    if sig == signal.SIGABRT and beat.get("nccl"):
        return text + ": NCCL's watchdog ends a worker so when one of its collectives timed out"
    if sig == signal.SIGABRT:
        return text + ": abort() in native code"
    if sig in CRASH_SIGNALS:
        return text + ": a crash in native code"
    if sig == signal.SIGKILL:
        return text + ": killed from outside (the kernel's out-of-memory killer, or a user)"
    return text


def publish_death(pid: int, beat: dict, reason: str, announce: bool = True) -> dict | None:
    """Publish, in the job's store, the failure of a worker that died without a word (unless a failure is there
    already: the worker's own, or an earlier one); returns the failure published, or None."""
    from torch.distributed import TCPStore

    from trainaccel.config import STORE_SCHEME
    from trainaccel.resilience import failfast, job_store

    rank, local_rank = beat.get("rank"), beat.get("local_rank")
    if announce:
        print(
            f"trainaccel run: local rank {local_rank} (rank {rank}, pid {pid}): {reason}", file=sys.stderr, flush=True
        )
    # The worker wrote its store's address in its heartbeat file: the store under torch's prefixes that it
    # connected to, whichever way the script started its group (env:// with torchrun's agent store or rank 0's,
    # tcp://, another launcher's variables). torchrun's MASTER_ADDR/MASTER_PORT name only the agent's default,
    # and torch's key prefixes change between versions; the worker's own account of it does neither.
    address, key = beat.get("store"), beat.get("key")
    if not address or key is None:
        return None  # not a TCP or etcd store (a file, a hash map): nothing this process can reach
    if isinstance(address, dict):  # the job's store on etcd
        named = address["etcd"].removeprefix(STORE_SCHEME)
    else:
        host, port = address
        named = f"{host}:{port}"
    failure = failfast.failure_record(
        rank,
        f"{reason} (published by its node's trainaccel run)",
        host=beat.get("host"),
        node=beat.get("node"),
        local_rank=local_rank,
    )
    failure["incarnation"] = beat.get("incarnation", 0)  # a rank started again to rejoin: which start died
    try:
        timeout = timedelta(seconds=STORE_CONNECT_S)
        # Bounded twice: a store cut off without a reset never answers, and TCPStore retries refused connections.
        if isinstance(address, dict):
            store = job_store.open_store(
                address["etcd"], address["job"], timeout=timeout, unavailable_s=STORE_CONNECT_S
            )
        else:
            store = failfast.bounded(
                lambda: TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False),
                STORE_CONNECT_S + 1,
            )
        if not failfast.publish_record(store, failure, key):
            return None
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        # A StoreTimeout's text names the store from this process's environment, not the worker's: said here.
        why = f"in {e.timeout_s:g} s" if isinstance(e, failfast.StoreTimeout) else f"({type(e).__name__}: {first})"
        print(
            f"trainaccel run: rank {rank}'s failure is not published: the job's store ({named}) did not answer {why}",
            file=sys.stderr,
            flush=True,
        )
        return None
    if not beat.get("survivors"):  # (under on_lost_replica=continue the peers read no failure: they drop the rank)
        failfast.await_readers(store, key, int(beat.get("world", 1)) - 1)  # before this node's agent takes the store
    return failure


def _pidfd(pid: int) -> int | None:
    """A descriptor readable once `pid` ended; None where the kernel has none (it is then looked at each check)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _children() -> list[int]:
    """This process's live children: torchrun's agent starts its workers from it."""
    me = os.getpid()
    try:  # the kernel's own list, per thread of this process
        listed = [Path(f"/proc/{me}/task/{tid}/children").read_text().split() for tid in os.listdir(f"/proc/{me}/task")]
        return [int(pid) for pids in listed for pid in pids]
    except (OSError, ValueError):
        pass
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = process_stat(int(entry.name))
            if stat is not None and stat[1] == me and stat[0] != "Z":
                found.append(int(entry.name))
    return found
