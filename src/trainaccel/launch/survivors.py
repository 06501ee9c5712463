"""`trainaccel run`'s exit barrier: torchrun's, which does not wait for the agents of lost replicas.

torchrun's agents wait at exit until every agent of the job has finished (300 s at most), so that the store, which the
first node's agent hosts, outlives every worker. Under on_lost_replica=continue a node whose replica was lost has an
agent that ended long before, or never comes: the others would wait out the 300 s. Here the barrier also ends once
every worker of the job has ended or was left out by the others (the `left/<rank>` keys each worker writes at exit,
and the membership's lost keys, in that store): then no worker needs the store any more. Without losses that is when
the last agent would have come anyway.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from trainaccel.resilience.failfast import departed, job_prefix, root_store

log = logging.getLogger("trainaccel")

POLL_S = 0.05  # torch's own barrier waits on the key: as soon after it as that


@contextlib.contextmanager
def exit_barrier_without_lost_replicas() -> Iterator[None]:
    """Inside, torchrun's agents (in this process) leave their exit barrier as described above; restored after."""
    from torch.distributed.elastic.agent.server import api

    original = api.SimpleElasticAgent._exit_barrier
    api.SimpleElasticAgent._exit_barrier = _exit_barrier
    try:
        yield
    finally:
        api.SimpleElasticAgent._exit_barrier = original


def _exit_barrier(agent: Any) -> None:
    """torchrun's exit barrier (its keys and timeout), ended too once every worker left or was left out."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _barrier_nonblocking

    group, store = agent._worker_group, agent._store
    world = group.workers[0].world_size if group.workers else 0
    prefix = job_prefix(group.spec.max_restarts - agent._remaining_restarts)  # the attempt its workers ran
    jobs_store = root_store(store)
    began = time.monotonic()
    try:
        last = _barrier_nonblocking(store=store, world_size=group.group_world_size, key_prefix=_TERMINAL_STATE_SYNC_ID)
        while time.monotonic() - began < agent._exit_barrier_timeout:
            if store.check([last]):
                return
            if world and departed(jobs_store, prefix, world) >= world:
                log.info("trainaccel run: every worker left or was left out: not waiting for the lost nodes' agents")
                return
            time.sleep(POLL_S)
    except Exception as e:  # the store's host ended (every worker had): nothing left to wait for
        log.info("trainaccel run: exit barrier ended (%s: %s)", type(e).__name__, e)
        return
    log.warning("trainaccel run: waited %.0f s at exit for the other nodes' agents", agent._exit_barrier_timeout)
