"""Which replicas take part in the syncs of `sync_every`, when one may be lost (`on_lost_replica=continue`).

Between syncs every replica trains alone, so a lost one (dead, hung or cut off) need not end the others: at the next
sync they drop it, and go on over a process group of their own (c10d's Gloo, built from the job's store, one per
membership). Each sync is a roll call, the exchange, then a vote, all decided through the store so that every
member decides alike:

1. Roll call: each member writes that it reached the sync, then waits until every member has either come, or is
   lost: it failed (a published failure), its heartbeat stopped for `LOST_AFTER_S`, or it has not come within the
   hang deadline (and the exchange's timeout: it may be stuck in a failed one). The first member to see the whole
   roll writes the decision (compare-and-set): who takes part.
2. The exchange runs over the decision's group (a new one whenever the members changed or the last try failed).
3. Vote: each member writes whether its exchange succeeded; the first to see every vote, or a member lost, writes
   the outcome. Commit: every member applies the result. Retry: the sync runs again from the roll call, from the
   same inputs, so that a sync some members finished and others did not is never applied by half of them.

A member the others dropped learns it from the store and ends with one line (it does not rejoin yet). The store
itself lives with the job's first node (torchrun's agent store): if that node is lost, every worker ends, as its
heartbeat says.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainaccel.resilience.failfast import (
    HEARTBEAT_S,
    LastChange,
    describe_failure,
    job_prefix,
    lost_key,
    read_heartbeats,
    root_store,
)

log = logging.getLogger("trainaccel")

LOST_AFTER_S = 3 * HEARTBEAT_S  # a heartbeat unchanged this long: its process is gone, frozen or cut off
TRIES = 3  # tries of one sync over the same members before every member gives up alike (not a lost member, then)
POLL_S = 0.05


class Dropped(RuntimeError):
    """This replica was left out of a sync by the others (they judged it lost); the message says why."""


class Membership:
    """The members of the syncs (global ranks), the group they exchange over, and the store that decides both."""

    __slots__ = {
        "members": "the global ranks taking part, sorted: all of the job's at first",
        "epoch": "how many times the members' group was rebuilt (a new group per change, and after a failed try)",
        "group": "the process group of the current members (the engine's own at first)",
        "rank": "this process's global rank",
        "timeout": "how long a collective of a rebuilt group waits (the job's collective_timeout)",
        "_store": "this object's own connection to the job's store",
        "_key": "the prefix of the membership's keys in the store",
        "_beats": "when this process last saw each rank's heartbeat change",
        "_world": "the job's size: heartbeats are read for every rank",
        "_done": "the names of the last committed sync's tries: their keys go at the next commit (all are past them)",
    }

    def __init__(self, group: dist.ProcessGroup, timeout_s: float):
        self.members = sorted(dist.get_process_group_ranks(group))
        if len(self.members) != dist.get_world_size():
            raise ValueError(
                "on_lost_replica=continue needs the syncs to span the whole job (its default group); this group has "
                f"{len(self.members)} of {dist.get_world_size()} ranks"
            )
        self.epoch, self.group, self.rank, self.timeout = 0, group, dist.get_rank(), timeout_s
        self._store = root_store(distributed_c10d._get_default_store()).clone()
        self._key = f"{job_prefix()}members/"
        self._beats = LastChange()
        self._world = dist.get_world_size()
        self._done: list[str] = []

    @property
    def size(self) -> int:
        return len(self.members)

    def run(self, sync: str, exchange: Callable[[dist.ProcessGroup, int], Any], hang_s: float | None) -> Any:
        """`exchange(group, members)` over the members who reach sync `sync` (the same name on every rank), retried
        until every member's try succeeded alike; `hang_s`: how long a member alive but absent is waited for."""
        # A member alive but absent may be inside a failed exchange until the group's timeout: waited for that long.
        patience = None if hang_s is None else max(hang_s, self.timeout + 2 * HEARTBEAT_S)
        attempt, tries, error = 0, 0, None
        while True:
            name = f"{sync}.{attempt}"
            decided = self._roll_call(name, patience)
            tries = tries + 1 if decided == self.members else 1
            if tries > TRIES:  # the same members failed it every time: a fault no member's loss explains
                raise RuntimeError(
                    f"sync {sync} failed {TRIES} times over the same {self.size} members; on this rank: "
                    f"{error or 'its exchange succeeded, another member failed'}"
                )
            if decided != self.members or attempt > 0 or self.epoch == 0:
                self._rebuild(decided, name)  # groups of its own from the first sync: see below
            try:
                result, ok = exchange(self.group, self.size), True
            except Exception as e:  # a member lost mid-exchange: Gloo's connection closed, or a timeout
                log.info("sync %s: the exchange failed on rank %d (%s: %s)", name, self.rank, type(e).__name__, e)
                result, ok, error = None, False, f"{type(e).__name__}: {e}"
                # Dropped, the group closes its connections: members still waiting in the same collective for this
                # one fail at once, instead of at the group's timeout, and come to the vote.
                self.group = None
            if self._vote(name, ok, patience):
                self._forget([f"{sync}.{a}" for a in range(attempt + 1)])
                return result
            attempt += 1

    # -- the store's decisions ---------------------------------------------------------------------------------

    def _roll_call(self, name: str, hang_s: float | None) -> list[int]:
        key = f"{self._key}{name}/"
        dropped = self._why_lost_already(self.rank)
        if dropped is not None:  # judged lost while away (frozen, or stuck in a failed exchange): never back in
            raise Dropped(f"the other replicas went on without rank {self.rank} before sync {name}: {dropped}")
        self._store.set(f"{key}here/{self.rank}", "1")
        decided = self._decide(key, "here", hang_s, lambda here, lost: json.dumps(here))
        members = json.loads(decided)
        if self.rank not in members:
            why = self._why_lost_already(self.rank) or "it was not at the sync when the others decided"
            raise Dropped(f"the other replicas went on without rank {self.rank} at sync {name}: {why}")
        gone = sorted(set(self.members) - set(members))
        if gone:
            reasons = "; ".join(f"rank {r}: {self._why_lost_already(r) or 'lost'}" for r in gone)
            log.warning("sync %s goes on with %d of %d replicas, without %s", name, len(members), self.size, reasons)
        return members

    def _vote(self, name: str, ok: bool, hang_s: float | None) -> bool:
        key = f"{self._key}{name}/"
        self._store.set(f"{key}vote/{self.rank}", "ok" if ok else "failed")

        def outcome(here: list[int], lost: list[int]) -> str:
            votes = [self._store.get(f"{key}vote/{r}").decode() for r in here]
            return "commit" if not lost and all(v == "ok" for v in votes) else "retry"

        return self._decide(key, "vote", hang_s, outcome, outcome_key="outcome") == "commit"

    def _decide(
        self,
        key: str,
        what: str,
        hang_s: float | None,
        conclude: Callable[[list[int], list[int]], str],
        outcome_key: str = "decision",
    ) -> str:
        """Wait until every member wrote `key/what/<rank>` or is lost; the first to see it all writes the outcome
        (`conclude(here, lost)`), which every member then reads."""
        began = time.monotonic()
        final = f"{key}{outcome_key}"
        while True:
            if self._store.check([final]):
                return self._store.get(final).decode()
            here, lost, beats = [], [], None
            for member in self.members:
                if member == self.rank or self._store.check([f"{key}{what}/{member}"]):
                    here.append(member)
                    continue
                if beats is None:  # read once per look, and only when someone is missing
                    beats = read_heartbeats(self._store, self._world, job_prefix())
                if self._lost(member, beats.get(member), time.monotonic() - began, hang_s):
                    lost.append(member)
            if len(here) + len(lost) == len(self.members):
                self._store.compare_set(final, "", conclude(here, lost))
                continue
            time.sleep(POLL_S)

    def _lost(self, rank: int, beat: dict | None, waited_s: float, hang_s: float | None) -> bool:
        """Whether `rank` is lost, judging it so in the store if this process is the first to see why."""
        if self._why_lost_already(rank) is not None:
            return True
        why = None
        failure_key = f"{job_prefix()}failure"
        if self._store.check([failure_key]):
            failure = json.loads(self._store.get(failure_key))
            if failure.get("by") == rank:
                why = describe_failure(failure)
        if why is None and beat is not None:  # (a rank that never beat is judged by the deadline alone)
            now = time.monotonic()
            silent = now - self._beats.update(rank, beat["time"], now)
            if silent >= LOST_AFTER_S:
                why = f"no heartbeat for {silent:.0f} s: its process is gone, frozen or cut off"
        if why is None and hang_s is not None and waited_s >= hang_s:
            why = f"alive, but it did not reach the sync within {hang_s:.0f} s"
        if why is None:
            return False
        self._store.compare_set(lost_key(rank), "", why)  # the first judgment stays
        return True

    def _forget(self, names: list[str]) -> None:
        """This member's keys of the previous committed sync. Its decisions and outcomes stay, small: a member
        that was away must read them, never decide them again."""
        for name in self._done:
            for what in ("here", "vote"):
                self._store.delete_key(f"{self._key}{name}/{what}/{self.rank}")
        self._done = names

    def _why_lost_already(self, rank: int) -> str | None:
        key = lost_key(rank)
        return self._store.get(key).decode() if self._store.check([key]) else None

    # -- the group ---------------------------------------------------------------------------------------------

    def _rebuild(self, members: list[int], name: str) -> None:
        """A fresh Gloo group over `members`, from the store (c10d's own pieces: no global group table involved)."""
        self.epoch += 1
        store = dist.PrefixStore(f"{self._key}group{self.epoch}/", self._store)
        rank, size = members.index(self.rank), len(members)
        timeout = datetime.timedelta(seconds=self.timeout)
        backend = dist.ProcessGroupGloo(store, rank, size, timeout)
        group = dist.ProcessGroup(store, rank, size)
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        for device in ("cpu", "cuda"):  # Gloo takes CUDA tensors too (through host memory)
            group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, backend)
        self.members, self.group = members, group
        log.info("sync %s: %d members, group %d", name, size, self.epoch)
