"""Where `DistributedOptimizer` negotiates and starts its collectives: the engine's communication thread.

Jobs run one at a time, in submission order, so every rank issues them in the order its backward
hooks submit them. Collectives called on any other thread (`hvd.allreduce`, `join`, a process set's
creation) first wait for the jobs submitted so far (`drain`): descriptor exchanges then follow call
order on every rank, as they would on one thread.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from trainaccel import context
from trainaccel.comm import owners
from trainaccel.comm.scheduler import COMM, comm_thread

_last: torch.futures.Future | None = None  # the newest job's future: the thread runs jobs in order
_inline = False  # jobs run on the caller's thread (see `keep_inline`)
_local = threading.local()  # .on_thread: a job of this module is running on this thread


def submit(job: Callable[[], None], device: torch.device | None = None) -> torch.futures.Future:
    """Run `job` after every job submitted before it; the future completes once it has run (`device`: as
    `CommThread.submit`). The job reports its own errors: they are not raised from the future."""
    global _last

    def run() -> None:
        _local.on_thread = True
        try:
            job()
        finally:
            _local.on_thread = False

    _registered()
    if _inline:
        drain()
        run()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done
    _last = comm_thread().submit(run, device)
    return _last


def drain() -> None:
    """Wait for every job submitted so far; nothing to wait for on the thread that runs them."""
    global _last
    last = _last
    if last is None or getattr(_local, "on_thread", False):
        return
    try:
        last.wait()
    except Exception:  # the job's owner reports it; here only the order matters
        pass
    owners.drained(COMM)  # this thread may issue directly on the process sets' groups again
    if _last is last:
        _last = None


def keep_inline() -> None:
    """From now until `reset()`, run jobs on the caller's thread: for collectives issued inside backward outside
    this module (SyncBatchNorm's), which must keep their place among the optimizer's on every rank."""
    global _inline
    _registered()
    drain()
    _inline = True


def _registered() -> None:
    """`trainaccel.shutdown()` resets this module too (after the thread has finished its jobs: registered first)."""
    if context.first_time("horovod background jobs"):
        context.on_undo("horovod background jobs", reset)


def reset() -> None:
    """Forget the jobs submitted so far and run jobs on the thread again (at init and shutdown)."""
    global _last, _inline
    _last, _inline = None, False
