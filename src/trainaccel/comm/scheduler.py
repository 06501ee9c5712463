"""The engine's communication threads and the process groups it owns.

Every collective trainaccel's hooks issue runs on one thread, in the order the hooks submit
work, which DDP makes the same on every rank (buckets in index order, models in autograd
order). The collectives go to groups of the engine's own (`engine_group`), never to the DDP
model's group, so DDP's own collectives on that group (the unused-parameter map, buffer
broadcasts) cannot interleave with ours differently on different ranks.

DiLoCo's syncs run on a second thread (`sync_thread`), on a CUDA stream of its own: a sync that
crosses a slow link for seconds (its roll call under on_lost_replica=continue included) never
holds up the next step's per-step jobs (sync_scope=node's average in the node). The two threads
never share a group: each group's collectives keep one thread's order on every rank, which the
owners check (`owners`) verifies.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import queue
import sys
import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainaccel import context
from trainaccel.comm import owners

log = logging.getLogger("trainaccel")


class CommThread:
    """Runs submitted jobs one at a time, in submission order, on a daemon thread.

    A job for a CUDA device runs on a stream of its own (one per device), after an event recorded on the submitting
    thread's stream (the bucket's gradients are produced there): the training stream never waits for a collective
    the job waits for, only the consumers of the job's result do, through the CUDA-aware future's events. A thread
    that `follows` another runs each job after the jobs submitted there before it (not the other way round).
    """

    def __init__(self, name: str = "trainaccel-comm", follows: CommThread | None = None):
        self.name, self.follows = name, follows
        self.last: torch.futures.Future | None = None  # the future of the job submitted last
        self.count = 0  # jobs submitted so far (a job's number: how many came before it)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # used on the thread only
        self._in_flight: collections.deque = collections.deque()  # (event, job) until the stream passed the job
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, job: Callable[[], Any], device: torch.device | None = None, groups: tuple = ()
    ) -> torch.futures.Future:
        """A future completed with `job()`'s result (or its error) once the thread has run it; `device`: where the
        job's tensors live (a CUDA one orders the job after the caller's work so far, on the thread's own stream);
        `groups`: those it issues on, where the engine's other thread may have issued last (the job then runs after
        that thread's jobs submitted so far: one order per group)."""
        # A CUDA-aware future makes its waiters' streams wait for the job's work, as c10d's futures do.
        cuda = device is not None and device.type == "cuda"
        fut: torch.futures.Future = torch.futures.Future(devices=[device] if cuda else [])
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        if issues_inline(device):  # one hardware queue: kernels keep the order the training thread issues them in
            return self._inline(job, fut, device, groups)
        handed = _handed_over(self.name, groups)  # (noted for every job: a later one of the other thread follows)
        other = self.follows or handed
        after = other.last if other is not None else None
        by, waited = owners.queued(fut, self.name, (COMM, SYNC))
        # {another thread: the number of its last job this one runs after} (it waited for them all, or follows them)
        upto = {name: _threads[name].count - 1 for name in waited if name in _threads}
        if other is not None:
            upto[other.name] = other.count - 1
        self._jobs.put((job, fut, device if cuda else None, ready, after, (by, self.count, upto)))
        self.last, self.count = fut, self.count + 1
        return fut

    def _inline(
        self, job: Callable[[], Any], fut: torch.futures.Future, device: torch.device, groups: tuple
    ) -> torch.futures.Future:
        """`job` run now on the calling thread, on its stream (`issues_inline`), after every job submitted so far."""
        _handed_over(self.name, groups)
        for thread in list(_threads.values()):
            _wait_quietly(thread.last)
        by, _ = owners.queued(fut, self.name, (COMM, SYNC))
        with owners.running_for(by, self.name, self.count, {name: t.count - 1 for name, t in _threads.items()}):
            _complete(job, fut)
        self.last, self.count = fut, self.count + 1
        return fut

    def run(self, job: Callable[[], Any], device: torch.device | None = None, groups: tuple = ()) -> Any:
        """`job()`'s result, run on this thread after the jobs submitted so far: the caller waits for all of them."""
        fut = self.submit(job, device, groups)
        result = fut.wait()
        self.waited(fut)
        return result

    def waited(self, fut: torch.futures.Future) -> None:
        """The caller waited for `fut`: if it was the last job submitted, for every job (they run in order)."""
        if fut is self.last:
            owners.drained(self.name)

    def finished(self, timeout_s: float | None = None) -> bool:
        """Wait until the jobs submitted so far have run, at most `timeout_s`; whether they have."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        self._jobs.put((done.set, torch.futures.Future(), None, None, None, (None, -1, {})))
        if not done.wait(timeout_s):
            return False
        owners.drained(self.name)
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
            job, fut, device, ready, after, (by, seq, upto) = item
            if device is None:
                _wait_quietly(after)
                with owners.running_for(by, self.name, seq, upto):
                    _complete(job, fut)
            else:
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device=device)
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    _wait_quietly(after)  # (a CUDA-aware future: this stream waits for the job's work too)
                    with owners.running_for(by, self.name, seq, upto):
                        _complete(job, fut)  # the future records its events on this stream
                    passed = torch.cuda.Event()
                    passed.record(stream)
                # The job holds tensors the caller allocated on its own stream: freed now, their memory could be
                # reused there before this stream has read them. They go once this stream has passed the job.
                self._in_flight.append((passed, job))
            while self._in_flight and self._in_flight[0][0].query():
                self._in_flight.popleft()
            del job, fut, ready, after


def issues_inline(device: torch.device | None) -> bool:
    """Whether jobs for `device` run on the thread that submits them rather than on an engine thread: on a GPU whose
    streams share one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron-style tensor parallelism sets, or an
    MPS client), where a NCCL kernel the engine's thread queued beside SyncBatchNorm's or tensor parallelism's in
    another order on another rank would wait behind it forever."""
    if device is None or device.type != "cuda":
        return False
    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" or bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))


def connect(groups: tuple, device: torch.device | None) -> None:
    """Build now, on the registering thread, the NCCL communicators of `groups` that the engine will use on `device`
    (call on every rank in one order): built lazily at a first collective on an engine thread, a communicator's
    set-up (its memory allocations wait for the device) could wait behind a NCCL kernel of the training thread
    that waits for a peer still setting up. Nothing to do on the CPU, or where they exist already."""
    if device is None or device.type != "cuda":
        return
    for group in groups:
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        try:
            backend = group._get_backend(device)
        except RuntimeError:  # no backend for the device on this group
            continue
        if getattr(backend, "supports_splitting", False) and not _connected(backend):
            backend.eager_connect_single_device(device)


def _connected(backend: Any) -> bool:
    initialized = getattr(backend, "_is_initialized", None)
    return bool(initialized()) if initialized is not None else False


# group -> the engine's thread that a job declaring it (`submit(groups=...)`) was submitted to last
_last_thread: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _handed_over(name: str, groups: tuple) -> CommThread | None:
    """The engine's other thread, if a job of it declared one of `groups` last: the job for thread `name` follows it."""
    other = None
    for group in groups:
        if group is None:
            continue
        last = _last_thread.get(group)
        if last is not None and last != name:
            other = _threads.get(last)
        _last_thread[group] = name
    return other


def _wait_quietly(job: torch.futures.Future | None) -> None:
    """Wait for `job` to have run; its error is its submitter's to report."""
    if job is not None:
        try:
            job.wait()
        except Exception:
            pass


def _complete(job: Callable[[], torch.Tensor], fut: torch.futures.Future) -> None:
    result = None
    try:
        result = job()
    except BaseException as e:  # surfaces in DDP's backward on this rank
        fut.set_exception(e)
    else:
        fut.set_result(result)


COMM = "trainaccel-comm"  # per-step jobs: the hooks' buckets, sync_scope=node's average in the node, Horovod's ops
SYNC = "trainaccel-sync"  # DiLoCo's syncs, auto's figures, the members' joins
_threads: dict[str, CommThread] = {}
_finishes_at_exit = False  # _end_at_exit registered with atexit


def comm_thread() -> CommThread:
    """This process's communication thread for per-step jobs (started on first use)."""
    return _started(COMM)


def sync_thread() -> CommThread:
    """This process's thread for DiLoCo's syncs (started on first use): apart from per-step jobs, on its own stream.
    A sync runs after the per-step jobs submitted before it: a group may pass from per-step jobs to syncs."""
    return _started(SYNC)


def _started(name: str) -> CommThread:
    global _finishes_at_exit
    thread = _threads.get(name)
    if thread is None:
        follows = comm_thread() if name == SYNC else None
        thread = _threads[name] = CommThread(name, follows)
        if context.first_time("communication threads"):
            context.on_undo("communication threads", stop_comm_thread)
        # Registered after the heartbeat's exit hook, it runs first: peers see this rank alive meanwhile.
        if not _finishes_at_exit:
            atexit.register(_end_at_exit)
            _finishes_at_exit = True
    return thread


# The longest wait for the jobs still queued when a group goes or the process ends (the collective timeout if less).
FINISH_WAIT_S = 30.0


def finish_queued_jobs() -> bool:
    """Before a group is destroyed (and, through the exit hook, before the process ends): the jobs queued so far on
    each thread (collectives every rank started, such as a sync of a model already dropped) run to their end, at most
    FINISH_WAIT_S; whether they did.

    Not while an error is ending the process: its peers may never finish them. A job that ends once the interpreter
    finalizes aborts the process ("terminate called without an active exception"): the c10d work its frame holds
    frees its tensors by taking the GIL back, and a thread that cannot is ended by pthread_exit through C++ frames.
    """
    if not _threads or _ending_on_error():
        return not _threads
    return all([thread.finished(_finish_wait_s()) for thread in list(_threads.values())])


def _ending_on_error() -> bool:
    return sys.exc_info()[1] is not None or getattr(sys, "last_value", None) is not None


def _finish_wait_s() -> float:
    config = context.current_config()
    return min(FINISH_WAIT_S, config.collective_timeout) if config is not None else FINISH_WAIT_S


def _end_at_exit() -> None:
    """At exit, the queued jobs run as in finish_queued_jobs, then the threads end: a thread merely woken to say they
    ran would go on in C++ (a future's completion, a CUDA event's query) with the GIL released, and abort the process
    when it takes the GIL back during finalization."""
    if _ending_on_error():
        return
    for name, thread in list(_threads.items()):
        if thread.stop(_finish_wait_s()):
            _threads.pop(name, None)


def stop_comm_thread() -> None:
    """End this process's communication threads after their pending jobs (`shutdown()`); the next use starts them."""
    for name, thread in list(_threads.items()):
        thread.stop()
        _threads.pop(name, None)


def before_ddp_unused_map(
    last_job: torch.futures.Future, ddp_group: dist.ProcessGroup | None, queue: str = COMM
) -> None:
    """At a step's last bucket, under find_unused_parameters: wait for `last_job` (jobs run in order, so for every
    job this thread queued on the engine's thread `queue`) before DDP all-reduces its unused-parameter map on
    `ddp_group` from this thread, so that every rank issues the engine's collectives and DDP's in one order. DDP's
    finalize would wait for the job next anyway; a failed job raises here, in backward."""
    last_job.wait()
    owners.drained(queue)
    owners.note(ddp_group, "DDP's unused-parameter map")


# DDP group -> {the engine's thread: its copy of it (same ranks, its own communicator)}.
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_group(group: dist.ProcessGroup | None, queue: str = COMM) -> dist.ProcessGroup:
    """The engine's own group over the ranks of `group` (None: the default group) for the jobs of its thread `queue`
    (`COMM`, per-step jobs; `SYNC`, DiLoCo's syncs: two threads never share a group); call on every rank of the job.

    Built once per group and thread, at registration on the calling thread. For a subgroup, every rank of the job
    builds every rank's copy, in one order (the ranks of each are gathered first): a default group bound to a device
    (`init_process_group(device_id=...)`) splits new NCCL communicators from its own, which every rank must join,
    members or not (built by the members alone, they would wait forever). On NCCL a copy costs GPU memory only once
    a collective runs on it: a job that never syncs (or never runs per-step jobs) holds one copy, not two.
    """
    owners.install_if_wanted()
    if queue not in (COMM, SYNC):
        raise ValueError(f"invalid queue={queue!r}; accepted: {COMM}, {SYNC}")
    group = dist.group.WORLD if group is None else group
    copies = _groups.setdefault(group, {})
    if queue not in copies:
        copies[queue] = _copy(group)
    return copies[queue]


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
