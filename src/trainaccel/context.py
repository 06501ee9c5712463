"""Process-wide state every module may read: the logger, rank-0/once messages, the current config, and the
registry of patches that `trainaccel.shutdown()` undoes. Torch-free, imports no other trainaccel module but one leaf.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainaccel.environment import env_rank

if TYPE_CHECKING:
    from trainaccel.config import Config

log = logging.getLogger("trainaccel")

_said: set[str] = set()
_config: Config | None = None  # set by init(), cleared by shutdown()
_undo: list[tuple[str, Callable[[], None]]] = []  # (what was changed, how to change it back), oldest first
_installed: set[str] = set()  # process-wide changes made once until undo_all() (see first_time)
_taken: set[str] = set()  # what took init()'s options in this process: "a DDP model", "hvd.DistributedOptimizer", ...
_MISSING = object()


def speaks_for_job() -> bool:
    """Whether this worker says what is true of the whole job: rank 0 of the default group, the lowest live rank once
    rank 0 was lost (on_lost_replica=continue), or a process that has no group (yet)."""
    dist = sys.modules.get("torch.distributed")  # never imported here: a process without torch is rank 0
    if dist is None or not dist.is_initialized():
        return True
    membership = sys.modules.get("trainaccel.resilience.membership")  # (imported by whoever keeps the members)
    live = membership.live_ranks() if membership is not None else None
    return dist.get_rank() == (min(live) if live else 0)


def rank() -> int:
    """This worker's rank: from the default group once it is up, else from the launcher's environment."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env_rank()


def say_once(level: int, message: str, every_rank: bool = False) -> None:
    """Log a fact about the whole job once, from rank 0 (or a fact about this worker, once, from it)."""
    if message not in _said and (every_rank or speaks_for_job()):
        _said.add(message)
        log.log(level, message)


def warn_once(message: str, every_rank: bool = False) -> None:
    say_once(logging.WARNING, message, every_rank)


def info_once(message: str) -> None:
    say_once(logging.INFO, message)


def current_config() -> Config | None:
    """The config set by the last `init()`, or None before it (and after `shutdown()`)."""
    return _config


def set_config(config: Config | None) -> None:
    global _config
    _config = config


def patch(owner: Any, name: str, value: Any) -> Any:
    """Set `owner.name` (a class's or module's attribute) to `value` until `undo_all()`; returns the previous value."""
    previous = vars(owner).get(name, _MISSING)

    def restore() -> None:
        if previous is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)

    setattr(owner, name, value)
    _undo.append((f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{name}", restore))
    return None if previous is _MISSING else previous


def on_undo(what: str, undo: Callable[[], None]) -> None:
    """Run `undo` at `undo_all()`, after everything registered later has been undone (a hook handle's remove...)."""
    _undo.append((what, undo))


def first_time(what: str) -> bool:
    """True the first time it is asked about `what` since the last `undo_all()`: install a process-wide change once."""
    if what in _installed:
        return False
    _installed.add(what)
    return True


def patched() -> list[str]:
    """What is changed now, oldest first (for logs and tests)."""
    return [what for what, _ in _undo]


def note_taken(what: str) -> None:
    """`what` (a DDP model, a sharded model, a Horovod optimizer, an explicit API object) took the options."""
    _taken.add(what)


def taken() -> bool:
    """Whether anything in this process took init()'s options since it was called."""
    return bool(_taken)


def undo_all() -> None:
    """Undo every registered change, newest first, and forget the config and the messages already said."""
    global _config
    errors = []
    while _undo:
        what, undo = _undo.pop()
        try:
            undo()
        except Exception as e:  # undo the rest anyway; report every failure at the end
            errors.append(f"{what}: {type(e).__name__}: {e}")
    _config = None
    _said.clear()
    _installed.clear()
    _taken.clear()
    if errors:
        raise RuntimeError("trainaccel.shutdown() could not undo: " + "; ".join(errors))
