"""A replica started again to rejoin a running job (`on_lost_replica=continue`).

When a worker of a job that goes on without lost replicas starts with a rank the others have judged lost (its
node's `trainaccel run` started again with the same command), it is that rank's next incarnation. It cannot take part
in the job's default process group, whose other members are many steps ahead: the script's group is a stand-in
(torch's `fake` backend: the right rank and size, no communication), and the script's own collectives on it end
with one line naming the call. Its model and outer state come from a live replica at their next round's end
(`Membership.join`), over a group of the members built from the job's store.

The members that went on without a lost replica refuse the script's collectives on their default group alike, once
they have lost one (`refuse_script_collectives`): the group still holds the lost process, so such a call would fail
on a Gloo error or wait for the collective timeout.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainaccel import context
from trainaccel.resilience import failfast

log = logging.getLogger("trainaccel")

STORE_CONNECT_S = 30.0
# The script's collectives on the default group: a stand-in there would return this rank's own values silently.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
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
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=STORE_CONNECT_S),
        wait_for_workers=False,
    )
    prefix = failfast.job_prefix()
    latest = failfast.latest_incarnation(store, rank, prefix)
    if not store.check([failfast.lost_key(rank, prefix, latest)]):
        return 0
    number = store.add(failfast.incarnation_key(rank, prefix), 1)
    failfast.become_incarnation(number)
    log.warning(
        "rank %d was lost from this job and the others went on: this process rejoins it (start %d of the rank); "
        "its model and outer state come from a live replica at their next sync",
        rank,
        number,
    )
    _start_stand_in_group(store, rank, int(os.environ["WORLD_SIZE"]))
    refuse_script_collectives(
        f"rank {rank} rejoined a running job, whose other replicas are at other steps, so its default group is a "
        "stand-in"
    )
    return number


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


def refuse_script_collectives(why: str) -> None:
    """From now until shutdown, the script's collectives on the default group end with one line: `why` it cannot
    use that group (torch's and trainaccel's own calls pass)."""
    if not context.first_time("script collectives refused"):
        return
    for module in (dist, distributed_c10d):
        for name in COLLECTIVES:
            if hasattr(module, name):
                context.patch(module, name, _refused(name, getattr(module, name), why))


def _refused(name: str, collective: Callable[..., Any], why: str) -> Callable[..., Any]:
    """`collective`, refused with one line when the script calls it on the default group."""
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def refused(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.startswith(("torch.", "trainaccel.")):  # torch's and trainaccel's own calls: theirs to route
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            if group is None or group is dist.group.WORLD:
                raise RuntimeError(
                    f"{name}() on the default group: {why}; under on_lost_replica=continue the replicas meet only in "
                    "trainaccel's syncs (sync_replicas() averages them)"
                )
        return collective(*args, **kwargs)

    return refused
