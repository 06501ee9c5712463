"""Fail fast: a collective timeout well under torch's 30 minutes, hung ranks named, and every node's job ended.

Every worker with trainaccel's hook writes a heartbeat (time, training step, step time) to the job's
store every few seconds. When a collective fails, `explain()` reads them: a peer whose heartbeat
stopped is gone or frozen; a peer at an earlier step has not reached the collective. The same
heartbeat thread ends its worker when the job is over elsewhere: a failure another rank published,
the store gone for `STORE_LOST_S`, or a hung rank named by a judge (ranks 0 and world-1 read every
heartbeat) once it stopped training for `hang_timeout` while its peers wait.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import json
import logging
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainaccel import context
from trainaccel.config import Config, env_setting
from trainaccel.devices import backend_of
from trainaccel.environment import worker_place
from trainaccel.observer import process_forwards, process_step
from trainaccel.resilience import job_store

log = logging.getLogger("trainaccel")

HEARTBEAT_S = 2.0
STORE_LOST_S = 15.0  # no answer from the job's store this long: the job is over (its first node ended or is gone)
HANG_MIN_S = 60.0  # hang_timeout=auto: at least this, and at least HANG_STEPS median step times
HANG_STEPS = 10
WARMUP_STEPS = 3  # hangs are judged once a rank began this many steps (the first ones compile, load, ...)
EXIT_STATUS = 1

AWAIT_POLL_S = 0.05  # how often await_peers reads the store and the heartbeats
_heartbeat: Heartbeat | None = None
_reports: dict[str, Callable[[], Any]] = {}  # extra heartbeat fields: name -> what to write
_published = False  # this process published the job's failure
_survivors = False  # on_lost_replica=continue: a peer's failure, death or hang drops it at the next sync instead
_incarnation = 0  # on_lost_replica=continue: how many times this rank was started again to rejoin (0: the first)
# A rank started again: the running job's replicas of several ranks (its nodes under sync_scope=node), as its members
# wrote them in the store; its own stand-in default group cannot tell.
_job_replicas: list[list[int]] = []
_first_ranks: list[int] = []  # a job that grows: [how many ranks start it] (start_growing); []: a job of fixed size
_attempt: int | None = None  # a worker restarted by its agent that rejoined the others' earlier attempt: that attempt


def job_prefix(attempt: int | None = None) -> str:
    """The prefix of a job attempt's keys in the store (heartbeats, the published failure, the membership); the
    attempt: this worker's (torchrun's restart count), or `attempt` for its launcher."""
    # Keyed by torchrun's attempt: a restarted job's store may still hold the last attempt's beats and failure.
    if attempt is None:
        attempt = _attempt if _attempt is not None else own_attempt()
    return f"trainaccel/{attempt}/"


def own_attempt() -> int:
    """torchrun's restart count of this worker (its agent's attempt), whichever attempt's job it runs in."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def join_attempt(attempt: int) -> None:
    """This process's keys are those of the job's attempt `attempt` (until shutdown), not its own restart count's: a
    worker restarted by its node's agent that rejoins the others, still running at that attempt."""
    global _attempt
    if context.first_time("attempt"):
        context.on_undo("attempt", functools.partial(globals().__setitem__, "_attempt", None))
    _attempt = attempt


def rejoined_attempt_key(attempt: int, node: int) -> str:
    """The store key naming the job attempt that node `node`'s workers of torchrun attempt `attempt` rejoined, if
    they did (their agent's exit barrier counts that attempt's workers)."""
    return f"{job_prefix(attempt)}rejoined/{node}"


def lost_key(rank: int, prefix: str | None = None, incarnation: int = 0) -> str:
    """The store key saying why the other replicas went on without `rank`'s `incarnation` (on_lost_replica=continue);
    each incarnation of a rank started again to rejoin has its own."""
    return _start_key("lost", rank, prefix, incarnation)


def left_key(rank: int, prefix: str | None = None, incarnation: int = 0) -> str:
    """The store key a worker (`rank`'s `incarnation`) writes when it ends, whatever the cause."""
    return _start_key("left", rank, prefix, incarnation)


def _start_key(what: str, rank: int, prefix: str | None, incarnation: int) -> str:
    # The first start keeps the key it had before rejoining existed: `what/<rank>`; later ones `what/<rank>.<n>`.
    return f"{job_prefix() if prefix is None else prefix}{what}/{rank}{f'.{incarnation}' if incarnation else ''}"


def heartbeat_key(rank: int, prefix: str | None = None) -> str:
    """The store key of `rank`'s last heartbeat (any start of it)."""
    return f"{job_prefix() if prefix is None else prefix}heartbeat/{rank}"


def replicas_key(prefix: str | None = None) -> str:
    """The store key of the job's replicas that span several ranks (JSON lists of global ranks; [] where each rank is
    one), written by the members under on_lost_replica=continue."""
    return f"{job_prefix() if prefix is None else prefix}members/replicas"


def incarnation_key(rank: int, prefix: str | None = None) -> str:
    """The store counter of `rank`'s incarnations started again to rejoin (absent: none)."""
    return f"{job_prefix() if prefix is None else prefix}incarnations/{rank}"


def latest_incarnation(store: Any, rank: int, prefix: str | None = None) -> int:
    key = incarnation_key(rank, prefix)
    return int(store.get(key)) if store.check([key]) else 0


def departed(store: Any, prefix: str, world: int) -> int:
    """How many of a job attempt's `world` workers have ended (at exit, whatever the cause) or were left out by the
    others (each counted once: a worker left out may still end later); of a rank started again, its latest start."""
    return sum(latest_start_ended(store, rank, prefix) for rank in range(world))


def latest_start_ended(store: Any, rank: int, prefix: str) -> bool:
    """Whether `rank`'s latest start in the job attempt at `prefix` ended (at exit, whatever the cause) or was left
    out by the others."""
    latest = latest_incarnation(store, rank, prefix)
    return store.check([left_key(rank, prefix, latest)]) or store.check([lost_key(rank, prefix, latest)])


def incarnation() -> int:
    """This process's incarnation of its rank: 0, or how many times the rank was started again to rejoin."""
    return _incarnation


def become_incarnation(number: int, replicas: list[list[int]] | None = None) -> None:
    """This process rejoins a running job as its rank's incarnation `number` (until shutdown); `replicas`: the job's
    replicas of several ranks, as its members wrote them (`replicas_key`)."""
    global _incarnation
    if context.first_time("incarnation"):
        context.on_undo("incarnation", functools.partial(globals().__setitem__, "_incarnation", 0))
        context.on_undo("job replicas", _job_replicas.clear)
    _incarnation = number
    _job_replicas[:] = [list(ranks) for ranks in replicas or []]


def start_growing(first: int, nodes: list[list[int]]) -> None:
    """This worker's job grows (`--nnodes MIN:MAX` on etcd): ranks below `first` start it, the others join later;
    `nodes`: the global ranks of each of its places for a node (until shutdown)."""
    if context.first_time("job grows"):
        context.on_undo("job grows", _first_ranks.clear)
        context.on_undo("job replicas", _job_replicas.clear)
    _first_ranks[:] = [first]
    _job_replicas[:] = [list(ranks) for ranks in nodes]


def first_ranks() -> int | None:
    """A job that grows: how many ranks start it (the others are places for nodes that join); None: fixed size."""
    return _first_ranks[0] if _first_ranks else None


def job_replicas() -> list[list[int]]:
    """A rank started again to rejoin: the running job's replicas of several ranks (its nodes under sync_scope=node),
    as its members wrote them; [] where each rank is one, and in a worker of the job's first start."""
    return [list(ranks) for ranks in _job_replicas]


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
    """A daemon thread writing this worker's time, place, step and step time to the store, and ending the
    worker when the job is over elsewhere (see the module's docstring)."""

    def __init__(
        self,
        progress: Callable[[], int] = process_step,
        interval_s: float = HEARTBEAT_S,
        config: Config | None = None,
    ):
        config = config or context.current_config() or Config()
        self.rank, self.world = dist.get_rank(), dist.group.WORLD
        self.size = dist.get_world_size()
        # The default store itself is held too: where a worker hosts it (rank 0 without torchrun's agent store),
        # it then lives until this process leaves, not until the script destroys its group.
        self._server = distributed_c10d._get_default_store()
        # Its own connection (no lock with the main thread), to the store under torch's prefixes: the keys are
        # then where a worker's launcher finds them from the address in the worker's heartbeat file.
        self._store = root_store(self._server).clone()
        self._progress, self._interval = progress, interval_s
        self._collective_timeout = config.collective_timeout
        self._hang_timeout = config.hang_timeout
        host, local_rank = worker_place()
        self._place = {"host": host, "node": os.environ.get("GROUP_RANK"), "local_rank": local_rank}
        self._key = job_prefix()
        self._stop = threading.Event()
        self._steps = StepClock()
        self._answered = time.monotonic()  # when the store last answered
        self._error: str | None = None  # the last beat's failure, if it failed
        self._leaving_seen = False  # some rank ended cleanly: the job is winding down, the store may go
        self._judge = HangJudge(config.hang_timeout) if self.rank in (0, self.size - 1) and self.size > 1 else None
        self._local_file = _local_heartbeat_file()
        self._local = {"rank": self.rank, "world": self.size, **self._place, "key": self._key}
        self._local["incarnation"] = _incarnation
        self._local.update(store=job_store.address(self._store), nccl=_reduces_cuda_with_nccl())
        self._beat()
        self._write_local()
        self._thread = threading.Thread(target=self._run, name="trainaccel-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        step = self._progress()
        self._steps.observe(step, time.monotonic())
        extra = {name: value() for name, value in list(_reports.items())}
        beat = {
            **self._place,
            "time": time.time(),
            "step": step,
            "forwards": process_forwards(),
            "step_s": self._steps.median_s(),
            **extra,
        }
        self._store.set(heartbeat_key(self.rank, self._key), json.dumps(beat))
        mine = lost_key(self.rank, incarnation=_incarnation)
        if _survivors and self._store.check([mine]):
            why = self._store.get(mine).decode()
            end_process(f"ending rank {self.rank}: the other replicas went on without it: {why}")
        if not _survivors and self._store.check([self._key + "failure"]):
            failure = json.loads(self._store.get(self._key + "failure"))
            if failure["by"] != self.rank:
                self._store.add(self._key + "failure-read", 1)  # its publisher waits for every peer to read it
                end_process(f"ending rank {self.rank}: {describe_failure(failure)}")
        if not self._leaving_seen and self._store.check([self._key + "left"]):
            self._leaving_seen = True
        if self._judge is not None and not self._leaving_seen and not _survivors:
            beats = read_heartbeats(self._store, self.size, self._key)
            verdict = self._judge.observe(beats, time.monotonic(), self.size)
            if verdict is not None:
                end_process(f"ending rank {self.rank}: {verdict.text}", publish=verdict, store=self._store)

    def _run(self) -> None:
        beating: threading.Thread | None = None
        while not self._stop.wait(self._interval):
            # A store cut off without a reset never answers a read: each beat runs on a thread of its own, and
            # one still blocked is waited for, not joined by another.
            if beating is None or not beating.is_alive():
                beating = threading.Thread(target=self._beat_once, name="trainaccel-beat", daemon=True)
                beating.start()
                beating.join(timeout=self._interval)
            silent = time.monotonic() - self._answered
            # Once a rank ended cleanly the store may go with it: silence is no failure then. The local heartbeat
            # goes on, so that the launcher's watchdog still sees this worker alive.
            if not self._leaving_seen and silent >= STORE_LOST_S:
                end_process(
                    f"ending rank {self.rank}: the job's store ({job_store.describe()}) has not answered for "
                    f"{silent:.0f} s ({self._error or 'no reply'}): the job ended on another node, or "
                    f"{job_store.where()} is gone or cut off"
                )
            self._write_local()

    def _beat_once(self) -> None:
        try:
            self._beat()
            self._answered, self._error = time.monotonic(), None
        except Exception as e:
            self._error = type(e).__name__

    def limit_s(self) -> float | None:
        """How long this worker may go without a heartbeat before its node's launcher ends it; None: never."""
        if self._hang_timeout == 0:
            return None
        deadline = hang_deadline(self._hang_timeout, [self._steps.median_s()]) if self._steps.warm() else None
        return (deadline if deadline is not None else self._collective_timeout) + 3 * self._interval

    def _write_local(self) -> None:
        if self._local_file is None:
            return
        limit = self.limit_s()
        try:
            if limit is None:
                os.unlink(self._local_file)
                return
            temporary = f"{self._local_file}.{os.getpid()}"
            with open(temporary, "w") as f:
                # With what its launcher needs to publish a failure for it, should it die without a word.
                # `survivors`: the peers drop it at their next sync and read no failure (none to wait for).
                beat = {"pid": os.getpid(), "time": time.time(), "limit_s": limit, "survivors": _survivors}
                json.dump({**beat, **self._local}, f)
            os.replace(temporary, self._local_file)  # whole or not at all: the launcher reads it any time
        except OSError as e:
            log.debug("heartbeat file %s not written (%s)", self._local_file, e)

    def leave(self) -> None:
        """Stop, telling the peers this rank ended cleanly (so the store going away is no failure)."""
        self.stop()
        try:
            # Which rank left, too: its launcher's exit barrier counts the ranks gone (`departed`).
            mine = left_key(self.rank, self._key, _incarnation)
            bounded(lambda: self._store.set(mine, "1"), 2 * self._interval)
            left = bounded(lambda: self._store.add(self._key + "left", 1), 2 * self._interval)
            if self.size > 1 and _hosts_store(self.rank):
                # The store goes with this process: until every peer has left too, or for a beat and a half,
                # so that every peer reads that the end is clean.
                _wait_for(lambda: left >= self.size or self._store.add(self._key + "left", 0) >= self.size)
        except Exception:
            return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._interval)
        self.drop_local_file()

    def drop_local_file(self) -> None:
        """Remove this worker's heartbeat file: it ends having said why (its launcher publishes nothing for it)."""
        path, self._local_file = self._local_file, None  # not written again
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass


class StepClock:
    """This worker's time per training step: the median over its recent steps, seen at heartbeat resolution."""

    def __init__(self, window: int = 20):
        self._window = window
        self._samples: list[float] = []
        self._last: tuple[int, float] | None = None  # (step, when it was first seen)

    def observe(self, step: int, now: float) -> None:
        if self._last is None or step < self._last[0]:
            self._last = (step, now)
        elif step > self._last[0]:
            if self._last[0] > 0:  # time before the first step is start-up, not a step
                self._samples.append((now - self._last[1]) / (step - self._last[0]))
                del self._samples[: -self._window]
            self._last = (step, now)

    def warm(self) -> bool:
        return self._last is not None and self._last[0] >= WARMUP_STEPS and bool(self._samples)

    def median_s(self) -> float | None:
        return statistics.median(self._samples) if self._samples else None


def hang_deadline(hang_timeout: float | str, step_s: list[float | None]) -> float | None:
    """Seconds without progress after which a rank is hung; None when off (0) or auto without step times yet."""
    if hang_timeout == "auto":
        known = [s for s in step_s if s is not None]
        if not known:
            return None
        return max(HANG_MIN_S, HANG_STEPS * statistics.median(known))
    return float(hang_timeout) or None


class LastChange:
    """When this process last saw each rank's value change, by its own monotonic clock (peers' clocks may differ)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[Any, float]] = {}  # rank -> (its value, when it was first seen so)

    def update(self, rank: int, value: Any, now: float) -> float:
        """Record `rank`'s value at `now`; returns when it last changed (`now` if it just did, or is new)."""
        seen = self._seen.get(rank)
        if seen is None or seen[0] != value:
            self._seen[rank] = seen = (value, now)
        return seen[1]


class Verdict:
    """A hung rank named by a judge: which, and one line saying why."""

    __slots__ = ("rank", "text")

    def __init__(self, rank: int, text: str):
        self.rank, self.text = rank, text


class HangJudge:
    """Names a rank that stopped training while its peers wait, from successive reads of every heartbeat.

    Clocks are the judge's own (monotonic): when each rank's heartbeat and the slowest step last changed.
    A rank whose heartbeat stopped is stopped or stuck outside Python; a rank alive at the slowest step,
    with others further, has not reached their collective. At half the deadline it is warned about.
    """

    def __init__(self, hang_timeout: float | str):
        self.hang_timeout = hang_timeout
        self._beats = LastChange()  # each rank's heartbeat (its time)
        self._busy = LastChange()  # each rank's count of forwards
        self._slowest: tuple[int, float] | None = None  # (slowest step, when the judge saw it change)
        self._warned: set[tuple[int, int, str]] = set()

    def observe(self, beats: dict[int, dict], now: float, world: int | None = None) -> Verdict | None:
        beat_at = {rank: self._beats.update(rank, beat["time"], now) for rank, beat in beats.items()}
        busy_at = {rank: self._busy.update(rank, beat.get("forwards"), now) for rank, beat in beats.items()}
        world = len(beats) if world is None else world
        if len(beats) < world or min(b["step"] for b in beats.values()) < 1:
            return None  # not every rank trains yet: collective_timeout alone applies
        if max(b["step"] for b in beats.values()) < WARMUP_STEPS:
            return None  # the first steps compile, load, warm caches: collective_timeout alone applies
        deadline = hang_deadline(self.hang_timeout, [b.get("step_s") for b in beats.values()])
        if deadline is None:
            return None
        steps = {rank: beat["step"] for rank, beat in beats.items()}
        low, high = min(steps.values()), max(steps.values())
        if self._slowest is None or self._slowest[0] != low:
            self._slowest = (low, now)
        ahead = next(rank for rank, step in sorted(steps.items()) if step == high)
        candidates = []
        for rank in sorted(beats):
            silent = now - beat_at[rank]
            if silent > deadline / 2:
                why = f"no heartbeat for {silent:.0f} s: its process is gone, stopped, stuck outside Python, or cut off"
                candidates.append((rank, silent, "frozen", why))
            elif steps[rank] == low < high:
                # A rank evaluating alone runs forwards: busy, not hung (collective_timeout still bounds the wait).
                stuck = now - max(self._slowest[1], busy_at[rank])
                if stuck > deadline / 2:
                    why = f"alive but at step {low} for {stuck:.0f} s while rank {ahead} waits at step {high}"
                    candidates.append((rank, stuck, "behind", why))
        for rank, waited, kind, why in candidates:
            where = f"rank {rank} ({place(beats[rank])})"
            if waited > deadline:
                return Verdict(rank, f"{where} is hung: {why} (hang_timeout {self._describe(deadline)})")
            if (rank, steps[rank], kind) not in self._warned:
                self._warned.add((rank, steps[rank], kind))
                log.warning("%s may be hung: %s; it is ended at %.0f s (hang_timeout)", where, why, deadline)
        return None

    def _describe(self, deadline: float) -> str:
        if self.hang_timeout == "auto":
            return f"auto: {deadline:.0f} s"
        return f"{deadline:g} s"


def place(beat: dict) -> str:
    """Where a heartbeat's rank runs: `host h, node n, local rank l`."""
    node = f", node {beat['node']}" if beat.get("node") is not None else ""
    return f"host {beat['host']}{node}, local rank {beat['local_rank']}"


def publish_failure(reason: Verdict | BaseException | str, store: Any = None) -> None:
    """Tell every rank's heartbeat that the job failed here first (the first failure published stays)."""
    store = store if store is not None else (_heartbeat._store if _heartbeat is not None else None)
    if store is None:
        return
    if isinstance(reason, Verdict):
        text = reason.text
    elif isinstance(reason, BaseException):
        notes = [n for n in getattr(reason, "__notes__", ()) if n.startswith("trainaccel: ")]
        text = f"{type(reason).__name__}: {str(reason).strip().splitlines()[0] if str(reason).strip() else ''}"
        text += f" ({notes[0][len('trainaccel: ') :]})" if notes else ""
    else:
        text = reason
    me = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if isinstance(reason, Verdict):  # a verdict about another rank names that rank's place in its text
        failure = failure_record(reason.rank, text, by=me)
    else:
        host, local_rank = worker_place()
        failure = failure_record(me, text, host=host, node=os.environ.get("GROUP_RANK"), local_rank=local_rank)
        failure["incarnation"] = _incarnation
    try:
        publish_record(store, failure, job_prefix())
    except Exception as e:  # the store is gone too: the peers find out from it
        log.debug("failure not published (%s)", e)
        return
    global _published
    _published = True


def failure_record(
    rank: int,
    reason: str,
    host: str | None = None,
    node: str | None = None,
    local_rank: int | None = None,
    by: int | None = None,
) -> dict[str, Any]:
    """A failure as the job's store holds it: the failed rank, where it ran (host None: named in `reason`), why,
    and `by`, the rank that published it (its own heartbeat does not end it)."""
    return {
        "rank": rank,
        "by": rank if by is None else by,
        "host": host,
        "node": node,
        "local_rank": local_rank,
        "reason": reason[:1000],
    }


def publish_record(store: Any, failure: dict, prefix: str) -> bool:
    """Store `failure` as the job's failure (under key prefix `prefix`) unless one is there already; returns
    whether it is the job's failure now. Raises if the store does not answer within two heartbeats."""
    value = json.dumps(failure)
    held = bounded(lambda: store.compare_set(prefix + "failure", "", value), 2 * HEARTBEAT_S)
    return (held.decode() if isinstance(held, bytes) else held) == value


def await_readers(store: Any, prefix: str, readers: int) -> None:
    """Wait until `readers` peers have read the published failure, or for a beat and a half."""
    try:
        _wait_for(lambda: store.add(prefix + "failure-read", 0) >= readers)
    except Exception:
        return


def root_store(store: Any) -> Any:
    """The store under every PrefixStore that torch wraps around it (the job's TCPStore, under torchrun)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def describe_failure(failure: dict) -> str:
    if failure.get("host") is None:
        return f"the job failed: {failure['reason']}"
    return f"rank {failure['rank']} ({place(failure)}) failed first: {failure['reason']}"


def end_process(line: str, publish: Verdict | None = None, store: Any = None) -> None:
    """Print `trainaccel: line`, hand it to torchrun's failure report, publish `publish`, and exit now (the main
    thread may be blocked in a collective that only its timeout would end)."""
    try:
        sys.stderr.flush()
    except Exception:
        pass
    os.write(2, f"trainaccel: {line}\n".encode())  # unbuffered: nothing is flushed after os._exit
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:
            raise JobEnded(line)  # raised here, so that the report's traceback is this and not the store's error
        except JobEnded as ended:
            ErrorHandler().record_exception(ended)  # written only under torchrun (its error file)
    except Exception:
        pass
    if publish is not None:
        publish_failure(publish, store=store)
        linger()
    # Without its heartbeat file, its launcher knows that it ended having said why: nothing to publish for it.
    if _heartbeat is not None:
        _heartbeat.drop_local_file()
    os._exit(EXIT_STATUS)


def linger() -> None:
    """After publishing a failure: before exiting, which may take the store with it (the node's agent ends), wait
    until every peer has read the failure, or for a beat and a half. Said and recorded first: the agent may end
    this process meanwhile."""
    if not _published or _heartbeat is None or _survivors:  # (under on_lost_replica=continue no peer reads it)
        return
    await_readers(_heartbeat._store, _heartbeat._key, _heartbeat.size - 1)


def _wait_for(done: Callable[[], bool], timeout_s: float = 1.5 * HEARTBEAT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not bounded(done, timeout_s):
        time.sleep(0.05)


class JobEnded(RuntimeError):
    """Why trainaccel ended this worker (what torchrun's failure report shows)."""


def start_heartbeat() -> None:
    """Start this process's heartbeat for the current default group (call after it is up); idempotent."""
    global _heartbeat
    if not dist.is_initialized() or (_heartbeat is not None and _heartbeat.world is dist.group.WORLD):
        return
    show_stacks_on_abort()
    stop_heartbeat()  # an earlier group's (elastic jobs start new ones)
    if context.first_time("heartbeat"):
        context.on_undo("heartbeat", stop_heartbeat)
    try:
        _heartbeat = Heartbeat()
    except Exception as e:  # a store without clone or writes: training goes on, failures are not explained
        log.debug("no heartbeat (%s: %s): collective failures will not name the missing peers", type(e).__name__, e)


def survive_lost_peers() -> None:
    """Until shutdown, a peer's failure, death or hang no longer ends this worker: the membership of the syncs
    (`resilience.membership`) drops that peer at the next sync. This worker still ends when the store is gone, or
    when the others dropped it."""
    global _survivors
    if context.first_time("survive lost peers"):
        context.on_undo("survive lost peers", _stop_surviving)
    _survivors = True


def surviving() -> bool:
    """Whether `survive_lost_peers()` is in effect."""
    return _survivors


def _stop_surviving() -> None:
    global _survivors
    _survivors = False


def show_stacks_on_abort() -> None:
    """On a default group that reduces CUDA tensors with NCCL: every thread's Python stack on a fatal signal (until
    shutdown). NCCL's watchdog ends a worker whose collective timed out with abort(), which no Python code outlives;
    the stacks still name the call it was stuck in."""
    if not _reduces_cuda_with_nccl() or faulthandler.is_enabled():
        return
    if context.first_time("stacks on abort"):
        faulthandler.enable(file=sys.stderr, all_threads=True)
        context.on_undo("stacks on abort", faulthandler.disable)


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
    return read_heartbeats(root_store(distributed_c10d._get_default_store()), dist.get_world_size(), _heartbeat._key)


def collective_timeout_s() -> float:
    """The configured collective_timeout (the default outside trainaccel.init())."""
    config = context.current_config()
    return (config or Config()).collective_timeout


def await_peers(
    key: str, me: int, peers: dict[int, int], moved_on: Callable[[dict], bool], timeout_s: float
) -> tuple[list[int], list[int]]:
    """Mark rank `me`'s arrival at `key` in the store, and wait until every peer arrived there or one moved on.

    Ranks are numbered as the caller's group does; `peers` maps each other rank to its global rank, whose
    heartbeat `moved_on` reads. Returns (peers that moved on, peers neither arrived nor moved on by the deadline);
    both empty when every peer arrived. One peer that moved on ends the wait: the others cannot change the outcome.
    """
    store = distributed_c10d._get_default_store()
    store.set(key + str(me), "1")
    pending, passed = set(peers), []
    deadline = time.monotonic() + timeout_s
    while pending:
        # Heartbeats first: a peer writes its arrival before moving on, so one that moved on without it never arrives.
        beats = heartbeats() or {}
        pending = {other for other in pending if not store.check([key + str(other)])}
        passed = sorted(other for other in pending if moved_on(beats.get(peers[other], {})))
        if passed or (pending and time.monotonic() > deadline):
            return passed, sorted(set(pending) - set(passed))
        if pending:
            time.sleep(AWAIT_POLL_S)
    return [], []


def stop_heartbeat() -> None:
    """Stop the heartbeat thread (trainaccel.shutdown(), or a new group replacing the old one)."""
    global _heartbeat, _published
    _published = False
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


@atexit.register
def leave() -> None:
    """At exit: stop the heartbeat before the interpreter finalizes (a thread in a store call would abort it),
    telling the peers this rank ended (after a failure, that failure is published first)."""
    global _heartbeat
    linger()
    if _heartbeat is not None:
        _heartbeat.leave()
        _heartbeat = None


def _reduces_cuda_with_nccl() -> bool:
    try:
        return backend_of(None, torch.device("cuda")) == "nccl"
    except Exception:  # a backend torch cannot name
        return False


def _local_heartbeat_file() -> str | None:
    folder = env_setting("heartbeat_dir")
    return os.path.join(folder, f"{os.environ.get('LOCAL_RANK', '0')}.json") if folder else None


def _hosts_store(rank: int) -> bool:
    # Under torchrun the agent hosts the store; otherwise (its restarts' fresh stores, mpirun) rank 0 does; on etcd
    # no process of the job.
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and not job_store.on_etcd()


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
        read = functools.partial(read_heartbeats, _heartbeat._store, world, _heartbeat._key)
        before = bounded(read, 2 * _heartbeat._interval)
        time.sleep(1.5 * _heartbeat._interval)
        after = bounded(read, 2 * _heartbeat._interval)
    except Exception as e:  # the store is gone too: the job's first host is down
        return (
            f"a collective failed on rank {me}; the job's store ({job_store.describe()}) cannot be reached either: "
            f"{job_store.where(its=True)} is gone or cut off ({e})"
        )
    missing = []
    for rank in range(world):
        beat = after.get(rank)
        if rank == me:
            continue
        if beat is None:
            missing.append(f"rank {rank}: no heartbeat ever (it never got as far as training)")
            continue
        where = f"rank {rank} ({place(beat)})"
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


class StoreTimeout(TimeoutError):
    """A `bounded` call to the job's store did not return within `timeout_s` seconds."""

    def __init__(self, timeout_s: float):
        super().__init__(f"the job's store ({job_store.describe()}) did not answer in {timeout_s:g} s")
        self.timeout_s = timeout_s


def bounded(fn: Callable[[], Any], timeout_s: float) -> Any:
    """`fn()`, on a daemon thread waited for at most `timeout_s` (a store cut off without a reset never answers)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, name="trainaccel-store-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StoreTimeout(timeout_s)
    if "error" in box:
        raise box["error"]
    return box.get("value")


def failed(error: BaseException) -> None:
    """An exception is ending this worker: name the missing peers in it and tell every rank the job failed here."""
    if isinstance(error, SystemExit) and error.code in (None, 0):
        return
    annotate(error)
    publish_failure(error if not isinstance(error, SystemExit) else f"the script exited with status {error.code}")


def read_heartbeats(store: dist.Store, world: int, prefix: str) -> dict[int, dict]:
    """Every rank's last heartbeat in the store, by rank (a rank that never beat is left out)."""
    keys = {rank: heartbeat_key(rank, prefix) for rank in range(world)}
    if store.check(list(keys.values())):  # every rank beats: one round trip
        return {rank: json.loads(value) for rank, value in zip(keys, store.multi_get(list(keys.values())))}
    return {rank: json.loads(store.get(key)) for rank, key in keys.items() if store.check([key])}
