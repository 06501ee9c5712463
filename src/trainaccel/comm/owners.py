"""A debug check that each process group is issued on by one thread only (TRAINACCEL_CHECK_OWNERS=1).

Two threads of one rank issuing collectives on one group (the engine's communication thread and the training thread,
say) interleave them in an order that may differ between ranks: Gloo then aborts on a size mismatch, NCCL hangs or
sums the wrong tensors. Whether it shows depends on timing; this check does not. Each group's first issuing thread
becomes its owner, and a collective from any other thread fails at once, naming both. Collectives torch issues
from C++ (DDP's unused-parameter map, its builtin allreduce) are noted by the engine's hooks where they run
(`note`). `shutdown()` removes the check.
"""

from __future__ import annotations

import contextlib
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
    """A second thread issued a collective on a process group another thread issues on."""


# group -> (thread id, thread name, what it issued first); weak: a destroyed group's entry goes with it.
_owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_seen: list[tuple[str, str, str]] = []  # (thread name, group's ranks, what): every first issue, for tests and logs
_lending: set[int] = set()  # threads blocked on c10d futures whose callbacks may issue on their groups (`lent`)


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
        _lending.clear()
        _owners.clear()
        _seen.clear()

    context.on_undo("collective owners check", forget)


def install_if_wanted() -> None:
    if wanted():
        install()


def note(group: Any, what: str) -> None:
    """`what` is issued on `group` (None: the default group) from this thread: fail if another thread owns it."""
    if not _installed:
        return
    group = distributed_c10d._get_default_group() if group is None or group is dist.group.WORLD else group
    if group is None or group is distributed_c10d.GroupMember.NON_GROUP_MEMBER:
        return
    thread = threading.current_thread()
    with _lock:
        owner = _owners.get(group)
        if owner is None:
            _owners[group] = (thread.ident, thread.name, what)
            _seen.append((thread.name, _ranks(group), what))
            return
    if owner[0] == thread.ident or (owner[0] in _lending and isinstance(thread, threading._DummyThread)):
        return  # the owner, or c10d's own thread (not one of Python's) running a callback while the owner waits
    message = (
        f"two threads issue collectives on one process group (ranks {_ranks(group)}): thread {owner[1]!r} issued "
        f"{owner[2]} and thread {thread.name!r} now issues {what}; their order could differ between ranks "
        "(Gloo aborts on a size mismatch, NCCL hangs): each group needs one issuing thread "
        "(TRAINACCEL_CHECK_OWNERS=1 checks this)"
    )
    log.error(message)
    raise SecondOwner(message)


@contextlib.contextmanager
def lent() -> Iterator[None]:
    """While this thread waits on c10d futures, their callbacks (on c10d's threads) may issue on its groups."""
    ident = threading.get_ident()
    _lending.add(ident)
    try:
        yield
    finally:
        _lending.discard(ident)


def owners() -> list[tuple[str, str, str]]:
    """(thread name, group's ranks, first collective) for each group issued on since the check was installed."""
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
