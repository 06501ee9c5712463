"""The roll call at scale: a sync costs each member a few store requests, whatever the number of members.

64 processes (one per member, as on 8 nodes of 8 GPUs) run the roll call and the vote of three syncs against one
TCPStore, each through a proxy that counts its requests. Polling each member's key every 50 ms, as the roll call once
did, costs every member at least 63 requests per decision, and 64 ranks some 80,000 a second while one is late.
"""

import multiprocessing
import statistics

import pytest
import torch.distributed as dist

MEMBERS = 64
SYNCS = 3
# Per member and sync: its roll call (is it lost already, here, count, wait, read) and its vote (the same but the
# first): 9, plus the decision the last to come writes (and the votes it reads in one request).
FEW = 12


class Counting:
    """A store that counts the requests made through it."""

    def __init__(self, store):
        self._store, self.requests = store, 0

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            self.requests += 1
            return method(*args, **kwargs)

        return counted


def _member(port: int, rank: int, barrier, results) -> None:
    from trainaccel.resilience.failfast import LastChange
    from trainaccel.resilience.membership import Membership

    store = Counting(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False))
    member = object.__new__(Membership)  # what Membership() sets up around a job's default group, without one
    member.members, member.rank, member._world = list(range(MEMBERS)), rank, MEMBERS
    member.incarnations = dict.fromkeys(range(MEMBERS), 0)
    member._store, member._key, member._beats, member._done = store, "scale/members/", LastChange(), []
    member._replica = {r: r for r in range(MEMBERS)}
    counts, decided = [], []
    barrier.wait()
    for sync in range(SYNCS):
        before = store.requests
        here = member._roll_call(f"sync{sync}.0", None)
        committed = member._vote(f"sync{sync}.0", True, None)
        counts.append(store.requests - before)
        decided.append((here == list(range(MEMBERS)), committed))
    results.put((rank, counts, decided))


@pytest.mark.multiprocess
def test_a_sync_costs_each_of_64_members_a_few_store_requests():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "trainaccel.resilience.membership"])  # one import, forked 64 times
    barrier, results = context.Barrier(MEMBERS), context.Queue()
    procs = [context.Process(target=_member, args=(server.port, r, barrier, results)) for r in range(MEMBERS)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=240) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    assert sorted(rank for rank, _, _ in got) == list(range(MEMBERS))
    assert all(decided == [(True, True)] * SYNCS for _, _, decided in got)
    counts = [c for _, member_counts, _ in got for c in member_counts]
    # The median member's requests; a member descheduled past a look (LOOK_S) reads every member's key once more.
    assert statistics.median(counts) <= FEW, sorted(counts)
    assert sum(c <= FEW for c in counts) >= 0.9 * len(counts), sorted(counts)
