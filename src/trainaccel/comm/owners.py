"""A debug check that each process group's collectives follow one thread's order (TRAINACCEL_CHECK_OWNERS=1).

Two threads of a rank issuing collectives on one group (the engine's communication thread and the training thread,
say) interleave them in an order that may differ between ranks: Gloo then aborts on a size mismatch, NCCL hangs or
sums the wrong tensors. Whether it shows depends on timing; this check does not. A group's collectives come either
from one thread directly, or from jobs that thread queued on the engine's communication thread, in its order: the
first thread to order a group owns it. It fails at once when another thread issues on the group, or queues jobs that
do, or when the owner issues directly on it while jobs it queued are not known to be done (it must wait for them
first: `drained`). Collectives torch issues from C++ (DDP's unused-parameter map) are noted where the engine's hooks
see them (`note`). A thread torch started in C++ (autograd's device threads, which run DDP's hooks on a GPU) counts as
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


_uses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> _Use (a destroyed group's goes with it)
_lock = threading.Lock()
_seen: list[tuple[str, str, str]] = []  # (owner's name, group's ranks, what): every group's first issue, for tests
# thread -> the last job it queued on the communication thread (a future), until it waited for all (`drained`)
_queued: dict[int, Any] = {}
_job = threading.local()  # on the communication thread, .by: the (id, name) of the thread that queued the running job
_lending: dict[int, tuple[int, str]] = {}  # threads blocked on c10d futures -> the job's (`lent`)


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


def queued(job: Any) -> tuple[int, str]:
    """The calling thread queues `job` (its future) on the communication thread; returns who queued it."""
    by = _origin()
    if _installed:
        _queued[by[0]] = job
    return by


def drained() -> None:
    """The calling thread waited for every job it queued: it may issue directly on their groups again."""
    _queued.pop(_origin()[0], None)


def _still_queued(ident: int) -> bool:
    """Whether jobs `ident` queued may still run (they run in order: its last one is not done)."""
    job = _queued.get(ident)
    return job is not None and not job.done()


@contextlib.contextmanager
def running_for(by: tuple[int, str]) -> Iterator[None]:
    """On the communication thread: the job that runs inside was queued by thread `by`."""
    _job.by = by
    try:
        yield
    finally:
        _job.by = None


@contextlib.contextmanager
def lent() -> Iterator[None]:
    """While this job waits on c10d futures, their callbacks (on c10d's own threads) issue in its place."""
    ident = threading.get_ident()
    by = getattr(_job, "by", None)
    _lending[ident] = by if by is not None else (ident, threading.current_thread().name)
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
    by, job = getattr(_job, "by", None), True
    if by is None and isinstance(thread, threading._DummyThread) and _lending:  # a c10d callback (see lent)
        by = next(iter(_lending.values()))
    if by is None:
        by, job = _origin(), False
    with _lock:
        use = _uses.get(group)
        if use is None:
            use = _uses[group] = _Use(by, what)
            _seen.append((by[1], _ranks(group), what))
    why = None
    if use.owner[0] != by[0]:
        how = f"thread {by[1]!r} now issues {what}" if not job else f"a job thread {by[1]!r} queued now issues {what}"
        why = f"thread {use.owner[1]!r} ordered its collectives first ({use.first}) and {how}"
    elif not job and use.by_jobs and _still_queued(by[0]):
        why = (
            f"thread {by[1]!r} issues {what} on it directly while jobs it queued on the communication thread, which "
            "issue on it too, may still be running (wait for them first)"
        )
    if job:
        use.by_jobs = True
    if why is None:
        return
    message = (
        f"two threads' collectives on one process group (ranks {_ranks(group)}): {why}; their order could differ "
        "between ranks (Gloo aborts on a size mismatch, NCCL hangs) (TRAINACCEL_CHECK_OWNERS=1 checks this)"
    )
    log.error(message)
    raise SecondOwner(message)


def owners() -> list[tuple[str, str, str]]:
    """(owner thread's name, group's ranks, first collective) for each group issued on since the check was installed."""
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
