"""The engine's one communication thread and the process groups it owns.

Every collective trainaccel's hooks issue runs on one thread, in the order the hooks submit
work, which DDP makes the same on every rank (buckets in index order, models in autograd
order). The collectives go to groups of the engine's own (`engine_group`), never to the DDP
model's group, so DDP's own collectives on that group (the unused-parameter map, buffer
broadcasts) cannot interleave with ours differently on different ranks. One issuing thread is
also what NCCL needs to drive several communicators without deadlock.
"""

from __future__ import annotations

import atexit
import collections
import logging
import queue
import sys
import threading
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from trainaccel import context
from trainaccel.comm import owners

log = logging.getLogger("trainaccel")


class CommThread:
    """Runs submitted jobs one at a time, in submission order, on a daemon thread.

    A job for a CUDA device runs on a stream of its own (one per device), after an event recorded on the submitting
    thread's stream (the bucket's gradients are produced there): the training stream never waits for a collective
    the job waits for, only the consumers of the job's result do, through the CUDA-aware future's events.
    """

    def __init__(self, name: str = "trainaccel-comm"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # used on the thread only
        self._in_flight: collections.deque = collections.deque()  # (event, job) until the stream passed the job
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], torch.Tensor], device: torch.device | None = None) -> torch.futures.Future:
        """A future completed with `job()`'s result (or its error) once the thread has run it; `device`: where the
        job's tensors live (a CUDA one orders the job after the caller's work so far, on the thread's own stream)."""
        # A CUDA-aware future makes its waiters' streams wait for the job's work, as c10d's futures do.
        cuda = device is not None and device.type == "cuda"
        fut: torch.futures.Future = torch.futures.Future(devices=[device] if cuda else [])
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        self._jobs.put((job, fut, device if cuda else None, ready, owners.queued(fut)))
        return fut

    def finished(self, timeout_s: float | None = None) -> bool:
        """Wait until the jobs submitted so far have run, at most `timeout_s`; whether they have."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        self._jobs.put((done.set, torch.futures.Future(), None, None, None))
        if not done.wait(timeout_s):
            return False
        owners.drained()
        return True

    def stop(self, timeout_s: float | None = None) -> bool:
        """Finish the jobs submitted so far, then end the thread, waiting at most `timeout_s`; whether it ended."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut, device, ready, by = item
            if device is None:
                with owners.running_for(by):
                    _complete(job, fut)
            else:
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device=device)
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    with owners.running_for(by):
                        _complete(job, fut)  # the future records its events on this stream
                    passed = torch.cuda.Event()
                    passed.record(stream)
                # The job holds tensors the caller allocated on its own stream: freed now, their memory could be
                # reused there before this stream has read them. They go once this stream has passed the job.
                self._in_flight.append((passed, job))
            while self._in_flight and self._in_flight[0][0].query():
                self._in_flight.popleft()
            del job, fut, ready


def _complete(job: Callable[[], torch.Tensor], fut: torch.futures.Future) -> None:
    result = None
    try:
        result = job()
    except BaseException as e:  # surfaces in DDP's backward on this rank
        fut.set_exception(e)
    else:
        fut.set_result(result)


_thread: CommThread | None = None
_finishes_at_exit = False  # _end_at_exit registered with atexit


def comm_thread() -> CommThread:
    """This process's communication thread (started on first use)."""
    global _thread, _finishes_at_exit
    if _thread is None:
        _thread = CommThread()
        context.on_undo("communication thread", stop_comm_thread)
        # Registered after the heartbeat's exit hook, it runs first: peers see this rank alive meanwhile.
        if not _finishes_at_exit:
            atexit.register(_end_at_exit)
            _finishes_at_exit = True
    return _thread


# The longest wait for the jobs still queued when a group goes or the process ends (the collective timeout if less).
FINISH_WAIT_S = 30.0


def finish_queued_jobs() -> bool:
    """Before a group is destroyed (and, through the exit hook, before the process ends): the jobs queued so far
    (collectives every rank started, such as a sync of a model already dropped) run to their end, at most
    FINISH_WAIT_S; whether they did.

    Not while an error is ending the process: its peers may never finish them. A job that ends once the interpreter
    finalizes aborts the process ("terminate called without an active exception"): the c10d work its frame holds
    frees its tensors by taking the GIL back, and a thread that cannot is ended by pthread_exit through C++ frames.
    """
    if _thread is None or _ending_on_error():
        return _thread is None
    return _thread.finished(_finish_wait_s())


def _ending_on_error() -> bool:
    return sys.exc_info()[1] is not None or getattr(sys, "last_value", None) is not None


def _finish_wait_s() -> float:
    config = context.current_config()
    return min(FINISH_WAIT_S, config.collective_timeout) if config is not None else FINISH_WAIT_S


def _end_at_exit() -> None:
    """At exit, the queued jobs run as in finish_queued_jobs, then the thread ends: a thread merely woken to say they
    ran would go on in C++ (a future's completion, a CUDA event's query) with the GIL released, and abort the process
    when it takes the GIL back during finalization."""
    global _thread
    if _thread is not None and not _ending_on_error() and _thread.stop(_finish_wait_s()):
        _thread = None


def stop_comm_thread() -> None:
    """End this process's communication thread after its pending jobs (`shutdown()`); the next use starts one."""
    global _thread
    if _thread is not None:
        _thread.stop()
        _thread = None


def before_ddp_unused_map(last_job: torch.futures.Future, ddp_group: dist.ProcessGroup | None) -> None:
    """At a step's last bucket, under find_unused_parameters: wait for `last_job` (jobs run in order, so for every
    job this thread queued) before DDP all-reduces its unused-parameter map on `ddp_group` from this thread, so that
    every rank issues the engine's collectives and DDP's in one order. DDP's finalize would wait for the job next
    anyway; a failed job raises here, in backward."""
    last_job.wait()
    owners.drained()
    owners.note(ddp_group, "DDP's unused-parameter map")


# DDP group -> the engine's copy of it (same ranks, its own communicator).
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The engine's own group over the ranks of `group` (None: the default group); call on every rank of the job.

    Built once per group, at registration on the calling thread. For a subgroup, every rank of the job builds every
    rank's copy, in one order (the ranks of each are gathered first): a default group bound to a device
    (`init_process_group(device_id=...)`) splits new NCCL communicators from its own, which every rank must join,
    members or not (built by the members alone, they would wait forever).
    """
    owners.install_if_wanted()
    group = dist.group.WORLD if group is None else group
    mine = _groups.get(group)
    if mine is None:
        mine = _groups[group] = _copy(group)
    return mine


def _copy(group: dist.ProcessGroup) -> dist.ProcessGroup:
    ranks = dist.get_process_group_ranks(group)
    if group is dist.group.WORLD:
        return dist.new_group(ranks)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, ranks)
    mine = None
    for these in sorted({tuple(r) for r in every}):
        built = dist.new_group(list(these))
        if list(these) == ranks:
            mine = built
    return mine
