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

A member the others dropped learns it from the store and ends with one line. Its rank may come back: a process
started again with that rank (its node's `trainaccel run` started anew, `resilience.rejoin`) is the rank's next
incarnation. It asks to join; at the next round's end the members decide (in the store, alike) who joins, and the
join itself runs as a sync does: roll call with the joiners, a live member's state sent to them over a group built
for it, vote. Joins happen only there (a shrink-only membership between them), so every member meets the joiner at
the same step. A replica of several ranks (a node's workers under sync_scope=node) is lost whole and admitted whole,
its workers' per-step group built from the store at their join. The store itself lives with the job's first node
(torchrun's agent store): if that node is lost, every worker ends, as its heartbeat says; on etcd
(`store=etcd://...`) no node holds it.

A job that grows (`--nnodes MIN:MAX` on etcd) starts with the ranks of its first MIN nodes as members; the ranks of
each later place for a node are judged lost from the start ("not taken yet"), so a node that takes a place joins as a
rank started again does.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import json
import logging
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainaccel import context
from trainaccel.resilience import failfast, job_store
from trainaccel.resilience.failfast import (
    HEARTBEAT_S,
    LastChange,
    departed,
    describe_failure,
    end_process,
    incarnation,
    job_prefix,
    latest_incarnation,
    lost_key,
    read_heartbeats,
    replicas_key,
    root_store,
)
from trainaccel.resilience.rejoin import refuse_script_collectives, watch_script_collectives
from trainaccel.resilience.samplers import follow_membership

log = logging.getLogger("trainaccel")

LOST_AFTER_S = 3 * HEARTBEAT_S  # a heartbeat unchanged this long: its process is gone, frozen or cut off
TRIES = 3  # tries of one sync over the same members before every member gives up alike (not a lost member, then)
POLL_S = 0.05
# How long a member waits for a sync's decision before it looks at who is missing (and whether they are lost): a
# published failure is seen within this, a stopped heartbeat within LOST_AFTER_S plus this.
LOOK_S = 0.5


_latest: list[list[int]] = []  # the members of the Membership that changed last: [ranks] ([]: none in this process)
# torch's process groups that hold a process the members went on without (the default group, the engine's copies of
# it, the hierarchy's groups of the lost node...), and the members' own groups of earlier memberships that held one.
# On NCCL a communicator with a dead peer must be aborted: a shutdown (destroy_process_group) waits on the peer.
_holding_lost: weakref.WeakSet = weakref.WeakSet()
_retired: list[dist.ProcessGroup] = []  # the members' own groups that held a lost process: aborted at the end


def live_ranks() -> list[int] | None:
    """The global ranks present at the last sync (None: no membership in this process)."""
    return list(_latest[0]) if _latest else None


class Dropped(RuntimeError):
    """This replica was left out of a sync by the others (they judged it lost); the message says why."""


class Membership:
    """The members of the syncs (global ranks), the group they exchange over, and the store that decides both."""

    __slots__ = {
        "_members": "the global ranks taking part, sorted: all of the job's at first (`members`)",
        "incarnations": "each member's incarnation: 0, or which start of its rank it is (started again to rejoin)",
        "epoch": "how many times the members' group was rebuilt (a new group per change, and after a failed try)",
        "group": "the process group of the current members (the engine's own at first; None: none usable)",
        "_group_members": "the global ranks of `group`",
        "rank": "this process's global rank",
        "timeout": "how long a collective of a rebuilt group waits (the job's collective_timeout)",
        "_store": "this object's own connection to the job's store",
        "_key": "the prefix of the membership's keys in the store",
        "_beats": "when this process last saw each rank's heartbeat change",
        "_world": "the job's size: heartbeats are read for every rank",
        "_done": "the names of the last committed sync's tries: their keys go at the next commit (all are past them)",
        "_replica": "each rank's replica: its node under sync_scope=node (one lost rank loses its node's), else itself",
        "replica_group": "a node started again under sync_scope=node: its workers' group, built at their join (None: "
        "the job's own node group serves, or each rank is a replica)",
        "across": "sync_scope=node: the members at this worker's place in their node, one per node present (the "
        "change crosses nodes in two levels, each worker a shard of it); None: flat over `group`",
        "in_node": "with `across`: this node's workers, who gather the shards (a group of the syncs alone, aborted "
        "with the others after a failed try: a node-mate waiting in it fails at once)",
        "nodes": "sync_scope=node: the nodes present, each its members (global ranks), as `across` was built for",
        "_nodes": "sync_scope=node: the job's nodes (global ranks); None: each rank is a replica",
    }

    def __init__(self, group: dist.ProcessGroup, timeout_s: float):
        self.members = sorted(dist.get_process_group_ranks(group))
        if len(self.members) != dist.get_world_size():
            raise ValueError(
                "on_lost_replica=continue needs the syncs to span the whole job (its default group); this group has "
                f"{len(self.members)} of {dist.get_world_size()} ranks"
            )
        first = failfast.first_ranks()
        if first is not None:  # a job that grows: the ranks of its first nodes start it, the others join later
            self.members = [rank for rank in self.members if rank < first]
        self.incarnations = dict.fromkeys(self.members, 0)
        self.incarnations[dist.get_rank()] = incarnation()
        self.epoch, self.group, self.rank, self.timeout = 0, group, dist.get_rank(), timeout_s
        self._group_members = list(self.members)
        self._store = root_store(distributed_c10d._get_default_store()).clone()
        self._key = f"{job_prefix()}members/"
        self._beats = LastChange()
        self._world = dist.get_world_size()
        self._done: list[str] = []
        self.replica_group = self.across = self.in_node = None
        self.nodes: list[list[int]] = []
        self.group_replicas(None)  # each rank a replica, until the syncs' scope says otherwise (OuterSync.use_scope)
        watch_script_collectives()  # the script's own, on a group that will hold a lost replica
        follow_membership(live_ranks)  # job-wide DistributedSamplers split the data over the members present
        if context.first_time("membership recorded"):
            context.on_undo("membership recorded", _latest.clear)

    def group_replicas(self, replicas: list[list[int]] | None) -> None:
        """The global ranks of each replica where one spans several (a node's workers under sync_scope=node); None:
        each rank is a replica of its own."""
        self._replica = {rank: rank for rank in range(self._world)}
        for ranks in replicas or []:
            self._replica.update(dict.fromkeys(ranks, min(ranks)))
        self._nodes = [sorted(ranks) for ranks in replicas] if replicas else None
        if incarnation() == 0:  # what a rank started again checks before it rejoins (resilience.rejoin)
            self._store.set(replicas_key(), json.dumps(sorted(map(sorted, replicas or []))))
        if incarnation() == 0 and failfast.first_ranks() is not None and self.replica_group is None:
            # A job that grows has no real default group: its node's per-step exchange needs a group of its own, as
            # a node started again gets at its join (built now: every worker of the node wraps its model).
            mine = [r for r in range(self._world) if self._replica[r] == self._replica[self.rank]]
            if len(mine) > 1:
                where = dist.PrefixStore(f"{self._key}groups/start/replica{mine[0]}/", self._store)
                self.replica_group = self._gloo_group(where, mine)

    @property
    def members(self) -> list[int]:
        return self._members

    @members.setter
    def members(self, ranks: list[int]) -> None:
        self._members = ranks
        _latest[:] = [list(ranks)]  # what job-wide samplers split the data over (live_ranks)

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
            try:
                decided = self._roll_call(name, patience)
            except dist.DistNetworkError as e:  # the store itself is gone: nobody can decide, the job ends here
                _store_lost(self.rank, e)
            tries = tries + 1 if decided == self.members else 1
            if tries > TRIES:  # the same members failed it every time: a fault no member's loss explains
                raise RuntimeError(
                    f"sync {sync} failed {TRIES} times over the same {self.size} members; on this rank: "
                    f"{error or 'its exchange succeeded, another member failed'}"
                )
            if self.group is None or decided != self._group_members or attempt > 0 or self.epoch == 0:
                self._rebuild(decided, name)  # groups of its own from the first sync: see below
            try:
                result, ok = exchange(self.group, self.size), True
            except Exception as e:  # a member lost mid-exchange: Gloo's connection closed, or a timeout
                log.info("sync %s: the exchange failed on rank %d (%s: %s)", name, self.rank, type(e).__name__, e)
                result, ok, error = None, False, f"{type(e).__name__}: {e}"
                # Aborted, the group closes its connections: members still waiting in the same collective for this
                # one fail at once, instead of at the group's timeout, and come to the vote.
                for group in (self.group, self.across, self.in_node):
                    _abort(group)
                self.group = self.across = self.in_node = None
            try:
                voted = self._vote(name, ok, patience)
            except dist.DistNetworkError as e:
                _store_lost(self.rank, e)
            if voted:
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
            left, had = ({self._replica[r] for r in ranks} for ranks in (members, self.members))
            # A script that keeps each worker's batch now reads fewer examples a step, which costs quality: say so.
            log.warning(
                "sync %s goes on with %d of %d replicas, without %s; each step now reads the batches of %d workers, "
                "not %d, unless the script draws its global batch over trainaccel.comm.members(model)",
                name,
                len(left),
                len(had),
                reasons,
                len(members),
                len(self.members),
            )
            _note_lost(gone, self.group, self.across, self.in_node)
            lost = ", ".join(map(str, gone))
            refuse_script_collectives(f"it holds rank {lost}, which the replicas went on without at sync {name}")
        return members

    def _vote(self, name: str, ok: bool, hang_s: float | None) -> bool:
        key = f"{self._key}{name}/"
        self._store.set(f"{key}vote/{self.rank}", "ok" if ok else "failed")

        def outcome(here: list[int], lost: list[int]) -> str:
            votes = [v.decode() for v in self._store.multi_get([f"{key}vote/{r}" for r in here])] if here else []
            return "commit" if not lost and all(v == "ok" for v in votes) else "retry"

        return self._decide(key, "vote", hang_s, outcome, outcome_key="outcome") == "commit"

    # -- joins -------------------------------------------------------------------------------------------------

    def joiners_at(self, at: str) -> dict[int, int]:
        """At a point every member reaches alike (`at`, the same name on every rank): the ranks started again and
        waiting to rejoin ({rank: incarnation}), as the first member to look saw them (store reads only)."""
        key = f"{self._key}{at}/joiners"
        if self._store.add(f"{key}/looking", 1) == 1:  # one member looks (a request per rank), the others wait for it
            self._store.compare_set(key, "", json.dumps(self._waiting()))
        try:
            self._store.wait([key], datetime.timedelta(seconds=LOST_AFTER_S))
        except dist.DistStoreError:  # the member that looked is slow or gone: this one looks too (the first stays)
            self._store.compare_set(key, "", json.dumps(self._waiting()))
        return {int(r): n for r, n in json.loads(self._store.get(key)).items()}

    def admit(self, at: str, joiners: dict[int, int], state: Callable[[], bytes], hang_s: float | None) -> list[int]:
        """`joiners_at(at)` become members and get `state()` of a live member; returns the ranks admitted (a joiner
        lost meanwhile is not)."""
        members = sorted({*self.members, *joiners})
        incarnations = {**self.incarnations, **joiners}
        news = json.dumps({"at": at, "members": members, "incarnations": incarnations, "joiners": joiners})
        for rank, number in joiners.items():
            self._store.compare_set(f"{self._key}admitted/{rank}.{number}", "", news)
        replicas = len({self._replica[r] for r in self.members})
        log.info("%s: rank(s) %s rejoin the %d replicas", at, ", ".join(map(str, joiners)), replicas)
        self.members, self.incarnations = members, incarnations
        self.run(f"{at}/join", functools.partial(self._share, set(joiners), state), hang_s)
        return [r for r in joiners if r in self.members]

    def join(self, hang_s: float | None) -> bytes:
        """This process rejoins the running job (its rank's incarnation `incarnation()`): waits until the members
        admit it at their next round's end, and returns the state a live member sent."""
        number = incarnation()
        self._store.set(f"{self._key}join/{self.rank}", str(number))
        key = f"{self._key}admitted/{self.rank}.{number}"
        others = self._world - 1
        while not self._store.check([key]):
            if departed(self._store, job_prefix(), self._world) >= others:  # (this start is not among them)
                raise Dropped(f"rank {self.rank} could not rejoin: every other replica has ended")
            time.sleep(4 * POLL_S)
        news = json.loads(self._store.get(key))
        self.members = news["members"]
        self.incarnations = {int(r): n for r, n in news["incarnations"].items()}
        self.group, self._group_members = None, []
        joiners = {int(r) for r in news["joiners"]}
        log.info("rank %d rejoins at %s with %d members", self.rank, news["at"], self.size)
        state = self.run(f"{news['at']}/join", functools.partial(self._share, joiners, lambda: b""), hang_s)
        replica = sorted(r for r in self.members if self._replica[r] == self._replica[self.rank])
        if len(replica) > 1:  # its node's workers, admitted together: their per-step exchange needs a real group
            where = dist.PrefixStore(f"{self._key}groups/{news['at']}/replica{replica[0]}/", self._store)
            self.replica_group = self._gloo_group(where, replica)
        return state

    def _waiting(self) -> dict[int, int]:
        """Ranks outside the members whose latest start asked to join and is not lost: {rank: incarnation}. A replica
        of several ranks (a node's workers under sync_scope=node) joins whole: only once each of its ranks asked."""
        waiting = {}
        for rank in range(self._world):
            if rank in self.members or not self._store.check([f"{self._key}join/{rank}"]):
                continue
            number = int(self._store.get(f"{self._key}join/{rank}"))
            latest = latest_incarnation(self._store, rank, job_prefix())
            if number == latest > self.incarnations.get(rank, 0) and not self._store.check(
                [lost_key(rank, job_prefix(), number)]
            ):
                waiting[rank] = number
        whole = {self._replica[r] for r in waiting} - {self._replica[r] for r in range(self._world) if r not in waiting}
        return {rank: number for rank, number in waiting.items() if self._replica[rank] in whole}

    def _share(self, joiners: set[int], state: Callable[[], bytes], group: Any, members: int) -> bytes:
        """A join's exchange: the lowest-ranked member that is not joining sends `state()` to every member."""
        sources = [r for r in self.members if r not in joiners]
        if not sources:
            raise Dropped("no replica of the running job is left to rejoin from")
        mine = state() if self.rank == sources[0] else b""
        length = torch.tensor([len(mine)], dtype=torch.int64)
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
        payload = torch.zeros(int(length), dtype=torch.uint8)
        if mine:
            payload.copy_(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
        dist.all_reduce(payload, group=group)  # the sender's bytes plus zeros: a broadcast over all_reduce
        return payload.numpy().tobytes()

    # -- the store's decisions, continued ----------------------------------------------------------------------

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
        # Every member counts itself in: the last to come concludes at once, and the others wait on the outcome's
        # key (the store answers when it is written). Requests per member and sync stay a few whatever the job's
        # size; the look at each member (its key, heartbeats, a published failure) is for a sync someone is late to.
        if self._store.add(f"{key}{what}/count", 1) == len(self.members):
            self._store.compare_set(final, "", conclude(list(self.members), []))
        while True:
            try:
                self._store.wait([final], datetime.timedelta(seconds=LOOK_S))
                return self._store.get(final).decode()
            except dist.DistStoreError:  # not decided yet: someone is late, or lost
                pass
            here, lost, beats = [], [], None
            for member in self.members:
                if member == self.rank or self._store.check([f"{key}{what}/{member}"]):
                    here.append(member)
                    continue
                if beats is None:  # read once per look, and only when someone is missing
                    beats = read_heartbeats(self._store, self._world, job_prefix())
                if self._lost(member, beats.get(member), time.monotonic() - began, hang_s):
                    lost.append(member)
            if lost:
                here, lost = self._lose_replicas(here, lost)
            if len(here) + len(lost) == len(self.members):
                self._store.compare_set(final, "", conclude(here, lost))

    def _lost(self, rank: int, beat: dict | None, waited_s: float, hang_s: float | None) -> bool:
        """Whether `rank` is lost, judging it so in the store if this process is the first to see why."""
        if self._why_lost_already(rank) is not None:
            return True
        why = None
        failure_key = f"{job_prefix()}failure"
        if self._store.check([failure_key]):
            failure = json.loads(self._store.get(failure_key))
            # (a failure of an earlier start of the rank is not this one's)
            if failure.get("by") == rank and failure.get("incarnation", 0) == self.incarnations.get(rank, 0):
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
        self._store.compare_set(self._lost_key(rank), "", why)  # the first judgment stays
        return True

    def _lose_replicas(self, here: list[int], lost: list[int]) -> tuple[list[int], list[int]]:
        """A replica of several ranks (a node's workers) is lost with any one of them: its others are judged lost
        too, present or not (they cannot train on: their per-step exchange within the node holds the lost one)."""
        gone = {self._replica[r]: r for r in lost}
        for member in self.members:
            first = gone.get(self._replica[member])
            if member not in lost and first is not None:
                self._store.compare_set(self._lost_key(member), "", f"its node's replica is lost with rank {first}")
                lost.append(member)
        return [r for r in here if r not in lost], sorted(lost)

    def _forget(self, names: list[str]) -> None:
        """This member's keys of the previous committed sync. Its decisions and outcomes stay, small: a member
        that was away must read them, never decide them again."""
        for name in self._done:
            for what in ("here", "vote"):
                self._store.delete_key(f"{self._key}{name}/{what}/{self.rank}")
                self._store.delete_key(f"{self._key}{name}/{what}/count")  # all are past it (any member may go)
        self._done = names

    def _lost_key(self, rank: int) -> str:
        return lost_key(rank, job_prefix(), self.incarnations.get(rank, 0))

    def _why_lost_already(self, rank: int) -> str | None:
        key = self._lost_key(rank)
        return self._store.get(key).decode() if self._store.check([key]) else None

    # -- the group ---------------------------------------------------------------------------------------------

    def _rebuild(self, members: list[int], name: str) -> None:
        """A fresh Gloo group over `members`, from the store (c10d's own pieces: no global group table involved)."""
        self.epoch += 1
        # Keyed by the try's name, the same on every member (a joiner's count of rebuilds is its own).
        group = self._gloo_group(dist.PrefixStore(f"{self._key}groups/{name}/", self._store), members)
        self.members, self.group, self._group_members = members, group, list(members)
        self.across, self.in_node, self.nodes = None, None, []
        if self._nodes is not None:  # nodes are lost and admitted whole: the present ones have all their workers
            nodes = [node for node in self._nodes if node[0] in members]
            mine = next(node for node in nodes if self.rank in node)
            if len(nodes) > 1 and len({len(node) for node in nodes}) == 1 and len(mine) > 1:
                place, key = mine.index(self.rank), f"{self._key}groups/{name}/"
                across = [node[place] for node in nodes]
                self.across = self._gloo_group(dist.PrefixStore(f"{key}across{place}/", self._store), across)
                self.in_node = self._gloo_group(dist.PrefixStore(f"{key}node{mine[0]}/", self._store), mine)
                self.nodes = nodes
        log.info("sync %s: %d members, group %d", name, len(members), self.epoch)

    def _gloo_group(self, store: dist.Store, ranks: list[int]) -> dist.ProcessGroup:
        """A Gloo group over the global ranks `ranks` (this one among them), rendezvous at `store`."""
        rank, size = ranks.index(self.rank), len(ranks)
        backend = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=self.timeout))
        group = dist.ProcessGroup(store, rank, size)
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        for device in ("cpu", "cuda"):  # Gloo takes CUDA tensors too (through host memory)
            group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, backend)
        return group


# -- groups that hold a lost process -------------------------------------------------------------------------------


def _note_lost(gone: list[int], *own: dist.ProcessGroup | None) -> None:
    """The members went on without `gone` (global ranks): every group that holds one of them, torch's and the members'
    last ones (`own`), is never used again and is aborted at the end (`abort_groups_holding_lost`)."""
    world = distributed_c10d._world  # torch's registry of process groups: {group: {global rank: group rank}}
    for group, ranks in list(world.pg_group_ranks.items()):
        if isinstance(group, dist.ProcessGroup) and set(ranks) & set(gone):  # (non-members' groups are numbers)
            _holding_lost.add(group)
    for group in own:
        if group is not None and group not in world.pg_group_ranks:  # (the members' first group is torch's)
            _retired.append(group)
    if context.first_time("groups holding a lost process aborted at exit"):
        # A script that ends without destroy_process_group(): its groups go at interpreter exit, aborted first here.
        atexit.register(abort_groups_holding_lost)
        context.on_undo("groups holding a lost process aborted at exit", _forget_lost_groups)


def _forget_lost_groups() -> None:
    atexit.unregister(abort_groups_holding_lost)
    _holding_lost.clear()
    _retired.clear()


def _abort(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        try:
            group.abort()
        except Exception as e:  # (already aborted, or its backend cannot): the process goes on to its end
            log.debug("aborting a members' group: %s: %s", type(e).__name__, e)


def abort_groups_holding_lost() -> int:
    """Before the default group is destroyed (and at exit): abort every process group that holds a process the
    members went on without, rather than shut it down (NCCL's shutdown waits on a dead peer); the default group holds
    every rank, so then every group of torch's registry is aborted. Returns how many groups were aborted."""
    aborted = 0
    while _retired:
        _abort(_retired.pop())
        aborted += 1
    if not dist.is_initialized() or not any(g in _holding_lost for g in distributed_c10d._world.pg_group_ranks):
        return aborted
    held = len(distributed_c10d._world.pg_group_ranks)
    distributed_c10d._abort_process_group(None)  # every group at once, in one NCCL group call: none waits on another
    aborted += held
    _holding_lost.clear()
    log.info(
        "aborted %d process group(s) holding a lost replica's process instead of shutting them down (a shutdown waits "
        "on the lost peer)",
        aborted,
    )
    return aborted


def _store_lost(rank: int, error: Exception) -> None:
    """End this worker in one line: the job's store is gone under a sync (its node, or a majority of its members)."""
    from trainaccel.resilience.etcd_store import StoreUnavailable

    first = (str(error).strip().splitlines() or [""])[0][:300]
    if isinstance(error, StoreUnavailable):  # (its own line names the store)
        end_process(f"ending rank {rank}: {first}")
    end_process(
        f"ending rank {rank}: the job's store ({job_store.describe()}) is gone ({type(error).__name__}: {first}): "
        f"{job_store.where()} is lost or cut off, and the job with it (with the store on etcd, --store "
        "etcd://..., the other replicas would train on)"
    )
