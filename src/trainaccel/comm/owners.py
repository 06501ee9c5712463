"""A debug check that each process group's collectives follow one thread's order (TRAINACCEL_CHECK_OWNERS=1).

Two threads of a rank issuing collectives on one group (the engine's communication thread and the training thread,
say) interleave them in an order that may differ between ranks: Gloo then aborts on a size mismatch, NCCL hangs or
sums the wrong tensors. Whether it shows depends on timing; this check does not. A group's collectives come either
from one thread directly, or from jobs that thread queued on the engine's communication thread, in its order: the
first thread to order a group owns it. It fails at once when another thread issues on the group, or queues jobs that
do, or when the owner issues directly on it while jobs it queued are not known to be done (it must wait for them
first: `drained`). Collectives torch issues from C++ (DDP's unused-parameter map) are noted where the engine's hooks
see them (`note`). The engine has two job threads (per-step jobs, and DiLoCo's syncs): a group's jobs all run on
one of them. A thread torch started in C++ (autograd's device threads, which run DDP's hooks on a GPU) counts as
the main thread, which waits in backward() meanwhile, as on the CPU, where backward runs on the caller's thread. A job
that waits on a chain of c10d futures (torch's PowerSGD hook issues its next collective from
the previous one's callback, on Gloo's own thread) lends its place to those callbacks (`lent`). `shutdown()` removes
the check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainaccel import context
from trainaccel.config import env_setting

log = logging.getLogger("trainaccel")

# torch.distributed's collectives and point-to-point calls that take a group (`group`, or `process_group`).
CHECKED = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",  # (newer torch's names for the two above)
    "reduce_scatter_single",
    "all_gather_object",
    "all_gather_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "_broadcast_coalesced",  # DDP's start and its buffer broadcast in forward
)


class SecondOwner(RuntimeError):
    """A group's collectives were ordered by a second thread, or issued before the jobs that use it were done."""


@dataclasses.dataclass
class _Use:
    owner: tuple[int, str]  # (id, name) of the thread whose order the group's collectives follow
    first: str  # what it issued first
    by_jobs: bool = False  # some of them ran as jobs of the engine's communication thread
    queue: str | None = None  # the engine's thread whose job issued on it last (None: none ran as a job yet)
    seq: int = -1  # that job's number on its thread


_uses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> _Use (a destroyed group's goes with it)
_lock = threading.Lock()
# (owner's name, group's ranks, what, the thread its jobs run on or None): every group's first issue, for tests
_seen: list[tuple[str, str, str, str | None]] = []
# (thread, engine thread) -> the last job it queued there (a future), until it waited for all there (`drained`)
_queued: dict[tuple[int, str], Any] = {}
# on an engine thread, .by: the (id, name) of the thread that queued the running job; .queue: the engine thread's
# name; .seq: the job's number there; .after: {another engine thread: the last of its jobs this one runs after}
_job = threading.local()
# threads blocked on c10d futures -> the job's (by, queue, seq, after) (`lent`)
_lending: dict[int, tuple[tuple[int, str], str | None, int, dict | None]] = {}


def wanted() -> bool:
    """Whether TRAINACCEL_CHECK_OWNERS asks for the check."""
    return (env_setting("check_owners") or "0").strip().lower() not in ("0", "off", "false", "no")


def active() -> bool:
    return bool(_installed)


_installed: list[bool] = []


def install() -> None:
    """Check every collective from now on (undone by `shutdown()`); installs once."""
    if _installed:
        return
    _installed.append(True)
    for name in CHECKED:
        original = getattr(distributed_c10d, name, None) or getattr(dist, name, None)
        if original is None:  # not in this torch release
            continue
        checked = _checked(name, original)
        for module in (distributed_c10d, dist):
            if name in vars(module):
                context.patch(module, name, checked)

    def forget() -> None:
        _installed.clear()
        _uses.clear()
        _seen.clear()
        _queued.clear()
        _lending.clear()

    context.on_undo("collective owners check", forget)


def install_if_wanted() -> None:
    if wanted():
        install()


def _origin() -> tuple[int, str]:
    """Whose order the calling thread's collectives and jobs follow: its own, or for a thread torch started in C++
    (autograd's device threads run DDP's hooks and SyncBatchNorm's backward on a GPU) the main thread's, which waits
    in backward() meanwhile: on the CPU, backward runs on the caller's thread itself."""
    thread = threading.current_thread()
    if isinstance(thread, threading._DummyThread):
        main = threading.main_thread()
        return (main.ident, main.name)
    return (thread.ident, thread.name)


def queued(job: Any, queue: str, queues: tuple[str, ...]) -> tuple[tuple[int, str], tuple[str, ...]]:
    """The calling thread queues `job` (its future) on the engine's thread `queue`; returns who queued it, and which
    of the engine's other threads `queues` it had waited for (`drained`): the job comes after all their jobs."""
    by = _origin()
    waited = tuple(q for q in queues if q != queue and (by[0], q) not in _queued)
    if _installed:
        _queued[(by[0], queue)] = job
    return by, waited


def drained(queue: str) -> None:
    """The calling thread waited for every job it queued on `queue`: it may issue directly on their groups again."""
    _queued.pop((_origin()[0], queue), None)


def _still_queued(ident: int, queue: str | None) -> bool:
    """Whether jobs `ident` queued on `queue` may still run (they run in order: its last one is not done)."""
    job = _queued.get((ident, queue)) if queue is not None else None
    return job is not None and not job.done()


@contextlib.contextmanager
def running_for(by: tuple[int, str], queue: str, seq: int = 0, after: dict[str, int] | None = None) -> Iterator[None]:
    """On the engine's thread `queue`: the job number `seq` there, queued by thread `by`, runs after the jobs
    numbered up to `after[q]` on each of the engine's other threads q."""
    _job.by, _job.queue, _job.seq, _job.after = by, queue, seq, after or {}
    try:
        yield
    finally:
        _job.by = _job.queue = _job.seq = _job.after = None


@contextlib.contextmanager
def lent() -> Iterator[None]:
    """While this job waits on c10d futures, their callbacks (on c10d's own threads) issue in its place."""
    ident = threading.get_ident()
    by, queue = getattr(_job, "by", None), getattr(_job, "queue", None)
    lender = (getattr(_job, "seq", 0), getattr(_job, "after", None))
    _lending[ident] = (by if by is not None else (ident, threading.current_thread().name), queue, *lender)
    try:
        yield
    finally:
        _lending.pop(ident, None)


def note(group: Any, what: str) -> None:
    """`what` is issued on `group` (None: the default group) from this thread: fail if its order is not one thread's."""
    if not _installed:
        return
    group = distributed_c10d._get_default_group() if group is None or group is dist.group.WORLD else group
    if group is None or group is distributed_c10d.GroupMember.NON_GROUP_MEMBER:
        return
    thread = threading.current_thread()
    by, queue = getattr(_job, "by", None), getattr(_job, "queue", None)
    seq, after = getattr(_job, "seq", 0), getattr(_job, "after", None) or {}
    if by is None and isinstance(thread, threading._DummyThread) and _lending:  # a c10d callback (see lent)
        by, queue, seq, after = next(iter(_lending.values()))
        after = after or {}
    job = by is not None
    if by is None:
        by = _origin()
    with _lock:
        use = _uses.get(group)
        if use is None:
            use = _uses[group] = _Use(by, what)
            _seen.append((by[1], _ranks(group), what, queue))
    why = None
    if use.owner[0] != by[0]:
        how = f"thread {by[1]!r} now issues {what}" if not job else f"a job thread {by[1]!r} queued now issues {what}"
        why = f"thread {use.owner[1]!r} ordered its collectives first ({use.first}) and {how}"
    elif job and use.queue is not None and use.queue != queue and use.seq > after.get(use.queue, -1):
        why = (
            f"jobs of thread {by[1]!r} issue on it from two engine threads, {use.queue!r} and now {queue!r} ({what}), "
            "whose collectives run at once in any order"
        )
    elif not job and use.by_jobs and _still_queued(by[0], use.queue):
        why = (
            f"thread {by[1]!r} issues {what} on it directly while jobs it queued on the communication thread, which "
            "issue on it too, may still be running (wait for them first)"
        )
    if job:  # (a job that runs after the last job of another thread on the group takes the group over)
        use.by_jobs, use.queue, use.seq = True, queue, seq
    if why is None:
        return
    message = (
        f"two threads' collectives on one process group (ranks {_ranks(group)}): {why}; their order could differ "
        "between ranks (Gloo aborts on a size mismatch, NCCL hangs) (TRAINACCEL_CHECK_OWNERS=1 checks this)"
    )
    log.error(message)
    raise SecondOwner(message)


def owners() -> list[tuple[str, str, str, str | None]]:
    """(owner thread's name, group's ranks, first collective, the engine thread its jobs run on or None) for each group
    issued on since the check was installed."""
    return list(_seen)


def _ranks(group: Any) -> str:
    try:
        return str(dist.get_process_group_ranks(group))
    except Exception:  # a group torch no longer knows (destroyed): its ranks cannot be read
        return "?"


def _checked(name: str, original: Callable) -> Callable:
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):  # a C++ binding: its group is its first argument
        signature = None

    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        note(_group_of(signature, args, kwargs), name)
        return original(*args, **kwargs)

    return checked


def _group_of(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> Any:
    if signature is None:
        return args[0] if args else kwargs.get("process_group")
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return None
    return bound.get("group", bound.get("process_group"))
