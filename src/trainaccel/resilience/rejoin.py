"""A replica started again to rejoin a running job (`on_lost_replica=continue`).

When a worker of a job that goes on without lost replicas starts with a rank the others have judged lost (its
node's `trainaccel run` started again with the same command, or its worker restarted by that launcher's agent,
`--max-restarts`, at torchrun's next attempt while the others run on at theirs), it is that rank's next
incarnation. It cannot take part in the job's default process group, whose other members are many steps ahead: the
script's group is a stand-in (torch's `fake` backend: the right rank and size, no communication), and the script's
own collectives on it end with one line naming the call. Its model and outer state come from a live replica at
their next round's end (`Membership.join`), over a group of the members built from the job's store.

A job that grows (`--nnodes MIN:MAX` with the store on etcd) starts with nodes 0 to MIN-1; the ranks of each later
node's place are judged lost from the start, so a node that takes a place joins as a rank started again rejoins.
With nodes missing, no real default group can start: every worker's is a stand-in, and DiLoCo's first sync sends
the lowest member's model to the others over the members' own group.

Under on_lost_replica=continue every worker refuses the script's collectives on the default group from its first
training step on (`watch_script_collectives`), naming the lost rank once there is one (`refuse_script_collectives`):
a call that met a loss would fail on a Gloo error or wait for the collective timeout (Lightning's per-batch SIGTERM
broadcast did), and after one the group still holds the lost process.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainaccel import context
from trainaccel.observer import process_step
from trainaccel.resilience import failfast, job_store

log = logging.getLogger("trainaccel")

STORE_CONNECT_S = 30.0
STILL_S = 3 * failfast.HEARTBEAT_S  # no other rank's heartbeat moved for this long: their job ended
VERDICT_POLL_S = 0.2
# The script's collectives on the default group: a stand-in there would return this rank's own values silently.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)


def prepare_rejoin() -> int:
    """Under torchrun: whether this worker's rank was lost from the job still running in its store; if so, this
    process becomes the rank's next incarnation, and the default group it starts is a stand-in. Returns the
    incarnation (0: a worker of the job's first start)."""
    if not context.first_time("rejoin checked"):  # init() again: decided at the first
        return failfast.incarnation()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "RANK" not in os.environ:
        return 0  # not torchrun's worker: nothing names the job's store before the group starts
    rank, world, own = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), failfast.own_attempt()
    if job_store.on_etcd():
        store = job_store.shared()
    else:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=STORE_CONNECT_S),
            wait_for_workers=False,
        )
    places = job_store.places(store) if job_store.on_etcd() else None
    first = None
    if places is not None:  # a job that grows: every worker's default group is a stand-in (see _grow)
        first = _grow(store, rank, world, places)
    if first is not None and rank < first and not _started_before(store, rank, own):
        # The job's start (its peers may beat already: with no real default group, none waits for the others): the
        # later nodes' places are free, written alike by every worker of the first nodes.
        for place in range(first, world):
            store.compare_set(failfast.lost_key(place, failfast.job_prefix(own)), "", PLACE_FREE)
        attempt = None
    else:
        attempt = _running_attempt(store, rank, world, own)
    if first is not None and rank >= first and attempt is None:
        attempt = _await_place(store, rank, world, own)
    if attempt is None or not _judged_lost(store, rank, world, failfast.job_prefix(attempt), attempt == own):
        if first is not None and rank >= first:
            raise RuntimeError(
                f"rank {rank} came to join a job that grows, and no worker of the job trains any more: it has ended"
            )
        if first is not None:
            _start_stand_in_group(store, rank, world)
            refuse_script_collectives(
                "a job that grows (--nnodes MIN:MAX) has no default group to communicate over: its nodes are not all "
                "there, so it is a stand-in"
            )
        return 0
    # Under sync_scope=node, the job's nodes: this worker's node rejoins as one replica, its workers together.
    key = failfast.replicas_key(failfast.job_prefix(attempt))
    replicas = json.loads(store.get(key)) if store.check([key]) else []
    if attempt != own:  # restarted by its node's agent, the others still at their attempt: this process joins it
        failfast.join_attempt(attempt)
        store.set(failfast.rejoined_attempt_key(own, int(os.environ.get("GROUP_RANK", "0"))), str(attempt))
    prefix = failfast.job_prefix(attempt)
    why = store.get(failfast.lost_key(rank, prefix, failfast.latest_incarnation(store, rank, prefix))).decode()
    number = store.add(failfast.incarnation_key(rank), 1)
    # (a job that grows: its nodes as _grow laid them out, as every worker of the job sees them)
    failfast.become_incarnation(number, replicas if places is None else failfast.job_replicas())
    if why == PLACE_FREE:
        log.warning(
            "rank %d takes a free place in a job that grows: this process joins it; its model and outer state come "
            "from a live replica at their next sync",
            rank,
        )
    else:
        log.warning(
            "rank %d was lost from this job and the others went on: this process rejoins it (start %d of the rank); "
            "its model and outer state come from a live replica at their next sync",
            rank,
            number,
        )
    _start_stand_in_group(store, rank, world)
    refuse_script_collectives(
        f"rank {rank} rejoined a running job, whose other replicas are at other steps, so its default group is a "
        "stand-in"
    )
    return number


def _grow(store: Any, rank: int, world: int, places: tuple[int, int]) -> int:
    """A worker of a job that grows: ranks of nodes 0 to MIN-1 start it, each later node's ranks wait, as places the
    members went on without, until a node takes them and joins (Membership.join). Returns how many ranks start it."""
    (first_nodes, most), per_node = places, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world != most * per_node:
        raise RuntimeError(
            f"a job that grows to {most} nodes of {per_node} workers has {most * per_node} ranks, not WORLD_SIZE "
            f"{world}: every node must run the same number of workers"
        )
    first = first_nodes * per_node
    failfast.start_growing(first, [list(range(n * per_node, (n + 1) * per_node)) for n in range(most)])
    return first


PLACE_FREE = "a place for a node to join (--nnodes MIN:MAX): not taken yet"
PLACE_WAIT_S = 600.0  # a node that joins before the job started: how long it waits for the job's first workers


def _started_before(store: Any, rank: int, own: int) -> bool:
    """Whether `rank` ran in this job before this process (it beat, ended or was judged lost at some attempt)."""
    for attempt in range(own, -1, -1):
        prefix = failfast.job_prefix(attempt)
        latest = failfast.latest_incarnation(store, rank, prefix)
        keys = [failfast.heartbeat_key(rank, prefix), failfast.lost_key(rank, prefix, latest)]
        if any(store.check([key]) for key in keys):
            return True
    return False


def _await_place(store: Any, rank: int, world: int, own: int) -> int:
    """A node joining a growing job that has not started yet: waits until the first workers free its places."""
    began = time.monotonic()
    while time.monotonic() - began < PLACE_WAIT_S:
        attempt = _running_attempt(store, rank, world, own)
        if attempt is not None:
            return attempt
        time.sleep(VERDICT_POLL_S)
    raise RuntimeError(
        f"rank {rank} came to join a job that grows, and no worker of its first nodes started within "
        f"{PLACE_WAIT_S:.0f} s: start nodes 0 to MIN-1 of --nnodes MIN:MAX first"
    )


def _running_attempt(store: Any, rank: int, world: int, own: int) -> int | None:
    """The attempt of a job that this rank's last start belonged to and that may still run: this worker's own attempt
    (its node's `trainaccel run` started anew), or an earlier one (its agent restarted it, `--max-restarts`, while the
    other nodes' workers went on). None: no such job, this is a worker of a fresh (or wholly restarted) job."""
    for attempt in range(own, -1, -1):
        prefix = failfast.job_prefix(attempt)
        latest = failfast.latest_incarnation(store, rank, prefix)
        if store.check([failfast.lost_key(rank, prefix, latest)]) or set(_beats(store, world, prefix)) - {rank}:
            return attempt
    return None


def _beats(store: Any, world: int, prefix: str) -> dict[int, float]:
    """The last heartbeat's time of each rank of the job attempt at `prefix` that neither ended nor was left out.
    (At a job's start no worker beats before every rank joined its group.)"""
    beats = failfast.read_heartbeats(store, world, prefix)
    return {rank: beat["time"] for rank, beat in beats.items() if not failfast.latest_start_ended(store, rank, prefix)}


def _judged_lost(store: Any, rank: int, world: int, prefix: str, own: bool) -> bool:
    """Whether the others judged this rank's last start lost at `prefix` and train on there: waits for their verdict
    (they give it at their next sync: it died, hung or was cut off). `own`: this worker's own attempt, where a verdict
    suffices; at an earlier one the others must also be seen training (a heartbeat moves), not a job wholly restarted
    since. False once no other rank trains there. A last start still beating is this rank, alive: this second start
    ends with one line."""
    latest = failfast.latest_incarnation(store, rank, prefix)
    lost = failfast.lost_key(rank, prefix, latest)
    first, began, training = _beats(store, world, prefix), time.monotonic(), False
    while True:
        beats = _beats(store, world, prefix)
        if rank in first and beats.get(rank, first[rank]) != first[rank]:
            raise RuntimeError(
                f"rank {rank} is already training in this job (its heartbeat goes on): this second start of it ends"
            )
        seen = training or any(beats.get(other, t) != t for other, t in first.items() if other != rank)
        if store.check([lost]) and (own or seen):
            return True
        if seen and not training:
            log.warning(
                "rank %d started again while the other replicas train on: waiting for them to drop its last start "
                "(at their next sync), to rejoin",
                rank,
            )
        training = seen
        if not set(beats) - {rank} or (not training and time.monotonic() - began > STILL_S):
            return False  # that job ended (its workers left, or were stopped: a whole job restarted)
        time.sleep(VERDICT_POLL_S)


def _start_stand_in_group(store: Any, rank: int, world: int) -> None:
    """The script's init_process_group starts the stand-in default group."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers torch's "fake" backend

    original = distributed_c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        timeout = kwargs.get("timeout")
        original("fake", store=store, rank=rank, world_size=world, **({"timeout": timeout} if timeout else {}))

    for module in (dist, distributed_c10d):
        context.patch(module, "init_process_group", init_process_group)


def watch_script_collectives() -> None:
    """Under on_lost_replica=continue, from now until shutdown: the script's collectives on the default group pass
    while it sets up, and end with one line from its first training step on, or once refused
    (`refuse_script_collectives`); torch's and trainaccel's own calls pass."""
    if not context.first_time("script collectives watched"):
        return
    context.on_undo("script collectives refused", _refusal.clear)
    context.on_undo("inner steps begun", _began.clear)
    for module in (dist, distributed_c10d):
        for name in COLLECTIVES:
            if hasattr(module, name):
                context.patch(module, name, _watched(name, getattr(module, name)))


def refuse_script_collectives(why: str) -> None:
    """From now until shutdown, the script's collectives on the default group end with one line: `why` it cannot
    use that group."""
    watch_script_collectives()
    if not _refusal:  # the first reason stays
        _refusal.append(why)


def training_began() -> None:
    """An inner step of sync_every ended: the script is training (counted where no DDP model's steps are observed: an
    explicit DiLoCo on a plain module, hvd.DistributedOptimizer)."""
    if not _began:
        _began.append(True)


_refusal: list[str] = []  # why the script's collectives on the default group are refused ([]: not yet)
_began: list[bool] = []  # [True] once an inner step ended (training_began)
# Callers whose collectives count as the script's: the Horovod API's are the script's hvd.allreduce and the like.
_SCRIPTS_OWN = ("trainaccel.horovod",)
# Wrappers of the same collectives, which pass every call on: the caller is the one that called them.
_PASSING_THROUGH = ("trainaccel.comm.owners",)


def _watched(name: str, collective: Callable[..., Any]) -> Callable[..., Any]:
    """`collective`, refused with one line when the script calls it on the default group in training."""
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def watched(*args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_globals.get("__name__") in _PASSING_THROUGH:
            frame = frame.f_back
        caller = frame.f_globals.get("__name__", "")
        # torch's and trainaccel's own calls are theirs to route; the Horovod API's are made for the script
        if caller.startswith(_SCRIPTS_OWN) or not caller.startswith(("torch.", "trainaccel.")):
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            if (group is None or group is dist.group.WORLD) and (_refusal or _began or process_step() > 0):
                raise RuntimeError(_refused(name, caller))
        return collective(*args, **kwargs)

    return watched


def _refused(name: str, caller: str) -> str:
    """The line refusing the script's collective `name` on the default group (called from module `caller`)."""
    why = (
        _refusal[0]
        if _refusal
        else (f"called by {caller or 'the script'} in training, where a lost replica would make it fail or hang")
    )
    line = (
        f"{name}() on the default group: {why}; under sync_every with on_lost_replica=continue the replicas meet "
        "only in trainaccel's syncs (sync_replicas() averages them; use on_lost_replica=stop for a script that "
        "needs its own collectives in training)"
    )
    if caller.startswith(_SCRIPTS_OWN):
        line += " (the script's hvd collective: average metrics over the replicas after training, or use stop)"
    if caller.startswith(("accelerate.", "transformers.")):
        line += " (Hugging Face's Trainer gathers token counts at every step and FLOPs at its end: use stop with it)"
    return line
