"""`hvd.elastic`: Horovod's elastic training API on torchrun's elastic agent.

Horovod recovers inside the running workers. Here torchrun restarts all workers after a
failure or a change of membership, and `run` continues from the newest commit on disk.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import torch.distributed as dist

from trainaccel.config import env_setting
from trainaccel.horovod.basics import check_initialized, rank, size
from trainaccel.horovod.elastic.sampler import ElasticSampler
from trainaccel.horovod.elastic.state import ObjectState, State, TorchState, state_dir
from trainaccel.horovod.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from trainaccel.horovod.ops import allgather_object

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]

log = logging.getLogger("trainaccel")
T = TypeVar("T")

# Frames of these files are where a collective fails when a peer is gone.
_COMM_PATHS = tuple(
    os.path.join(*parts) + os.sep
    for parts in [("torch", "distributed"), ("trainaccel", "horovod"), ("trainaccel", "comm")]
)


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorate the training function `func(state, *args, **kwargs)` to resume from the last commit.

    Before calling `func`, the workers agree on the newest commit, load it and sync `state`.
    When a collective fails, the error is logged with the commit the job will restart from and
    re-raised: the worker exits and torchrun restarts all workers (with `--max-restarts`).
    """
    if not callable(func):
        raise TypeError(f"hvd.elastic.run decorates a function, got {func!r}")
    name = getattr(func, "__qualname__", repr(func))
    _check_signature(func, name)

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        if not isinstance(state, State):
            raise TypeError(
                f"the first argument of {name} must be an hvd.elastic State (TorchState or "
                f"ObjectState), got {type(state).__name__}: {state!r:.80}"
            )
        check_initialized()
        try:
            _resume(state)
            result = func(state, *args, **kwargs)
        except Exception as error:
            if _is_comm_failure(error):
                log.warning("%s", _restart_line(state, error))
            raise
        _finish(state)
        return result

    return wrapper


def _resume(state: State) -> None:
    """Agree on the newest commit any worker holds, load it and sync every worker to it."""
    saved = state._read()
    everyone = allgather_object((saved["commit"], saved["size"]) if saved else (0, size()))
    newest = max(commit for commit, _ in everyone)
    root = next(r for r, (commit, _) in enumerate(everyone) if commit == newest)
    committed_size = everyone[root][1]
    if saved and saved["commit"] == newest:
        state._load(saved["state"])
    state._commits = newest
    if committed_size != size():
        state.on_reset()  # as Horovod does when hosts change: before the sync
    state._root = root
    try:
        state.sync()
    finally:
        state._root = 0
    if newest and rank() == 0:
        log.info(
            "hvd.elastic: resumed from commit %d (world size %d -> %d, state from rank %d)",
            newest,
            committed_size,
            size(),
            root,
        )


def _finish(state: State) -> None:
    """The function returned on this worker: its commit file is no longer needed."""
    path = state._file
    if path is None:
        return
    path.unlink(missing_ok=True)
    if not env_setting("elastic_dir"):
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # succeeds for the last worker out


def _check_signature(func: Callable[..., Any], name: str) -> None:
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return  # a builtin or extension: nothing to check
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    )
    if not parameters or parameters[0].kind not in positional:
        raise TypeError(f"hvd.elastic.run: {name} must take the state as its first positional argument")


def _is_comm_failure(error: BaseException) -> bool:
    """Whether `error` means the group is broken: Horovod's errors, c10d's, or a RuntimeError from a collective."""
    if isinstance(error, (HorovodInternalError, HostsUpdatedInterrupt, dist.DistError)):
        return True
    if not isinstance(error, RuntimeError):
        return False
    innermost: TracebackType | None = error.__traceback__
    while innermost is not None and innermost.tb_next is not None:
        innermost = innermost.tb_next
    return innermost is not None and any(part in innermost.tb_frame.f_code.co_filename for part in _COMM_PATHS)


def _restart_line(state: State, error: BaseException) -> str:
    """One line: what failed, and where the job goes on from."""
    message = (str(error).strip().splitlines() or [""])[0]
    if message.startswith("[") and "] " in message:
        message = message.split("] ", 1)[1]  # Gloo's source location
    if len(message) > 160:
        sentence = message.split(". ", 1)[0]
        message = sentence if len(sentence) <= 160 else message[:157] + "..."
    what = f"hvd.elastic: {type(error).__name__}: {message}"
    point = f"commit {state._commits}" if state._commits else "the start (no commit yet)"
    restarts, count = os.environ.get("TORCHELASTIC_MAX_RESTARTS"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restarts is None:
        return f"{what}; nothing restarts this worker outside torchrun, so the job ends at {point}"
    if int(count) < int(restarts):
        again = f"restart {int(count) + 1} of {restarts}"
        return f"{what}; torchrun will restart all workers ({again}) and resume from {point}"
    folder = state_dir()
    again = f"; a relaunch with TRAINACCEL_ELASTIC_DIR={folder} resumes from it" if folder and state._commits else ""
    return f"{what}; no restarts left (--max-restarts {restarts}), so the job ends at {point}{again}"
