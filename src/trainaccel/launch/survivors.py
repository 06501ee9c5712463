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

from trainaccel.resilience.failfast import departed, job_prefix, latest_incarnation, rejoined_attempt_key, root_store

log = logging.getLogger("trainaccel")

POLL_S = 0.05  # torch's own barrier waits on the key: as soon after it as that
LEAVE_S = 5.0  # at most this long the store's host waits for the other agents to see the barrier's end
QUIET_S = 1.0  # with nodes lost: no agent came for this long, none is still coming
AGAIN_AGENT_S = 10.0  # once every worker ended: how long the agent of a rank started again may take to come


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
    attempt = group.spec.max_restarts - agent._remaining_restarts  # the attempt its workers started in
    jobs_store = root_store(store)
    began, gone_at, again = time.monotonic(), None, False
    try:
        rejoined = rejoined_attempt_key(attempt, group.group_rank)  # its workers rejoined an earlier attempt's job
        prefix = job_prefix(int(jobs_store.get(rejoined)) if jobs_store.check([rejoined]) else attempt)
        last = _barrier_nonblocking(store=store, world_size=group.group_world_size, key_prefix=_TERMINAL_STATE_SYNC_ID)
        while time.monotonic() - began < agent._exit_barrier_timeout:
            if store.check([last]):
                return _leave(agent, jobs_store, prefix, everyone=True)
            if world and departed(jobs_store, prefix, world) >= world:
                # A rank started again has a live agent, a moment behind its worker's end: this agent may host the
                # store it comes to (a closed store would cost it a C++ error at exit), so it is given that moment.
                if gone_at is None:  # (read once: every start has ended by now)
                    gone_at = time.monotonic()
                    again = any(latest_incarnation(jobs_store, rank, prefix) for rank in range(world))
                if not again or time.monotonic() - gone_at >= AGAIN_AGENT_S:
                    log.info("trainaccel run: every worker left or was left out: not waiting for lost nodes' agents")
                    return _leave(agent, jobs_store, prefix, everyone=False)
            time.sleep(POLL_S)
    except Exception as e:  # the store's host ended (every worker had): nothing left to wait for
        log.info("trainaccel run: exit barrier ended (%s: %s)", type(e).__name__, e)
        return
    log.warning("trainaccel run: waited %.0f s at exit for the other nodes' agents", agent._exit_barrier_timeout)


def _leave(agent: Any, jobs_store: Any, prefix: str, everyone: bool) -> None:
    """Out of the barrier. The agent hosting the store (static rendezvous: the first node's) first waits, briefly,
    until every agent that came has seen the end (one still polling would find the store closed); `everyone`: all
    came. Otherwise a late one may still come: until none came for a moment."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _NUM_MEMBERS

    seen = jobs_store.add(f"{prefix}exit-seen", 1)
    if agent._worker_group.group_rank != 0 or agent._worker_group.spec.rdzv_handler.get_backend() != "static":
        return
    began = changed = time.monotonic()
    came = agent._store.add(_TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS, 0)
    while time.monotonic() - began < LEAVE_S:
        if seen >= came and (everyone or time.monotonic() - changed >= QUIET_S):
            return
        time.sleep(POLL_S)
        seen = jobs_store.add(f"{prefix}exit-seen", 0)
        now = agent._store.add(_TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS, 0)
        if now != came:
            came, changed = now, time.monotonic()
