"""64 members run the roll call and the vote of three syncs against the job's store, each counting its requests.

Usage: roll_call.py PORT MEMBERS SYNCS. This process imports torch once and forks the members (it has no other
thread, so forking is safe and each member starts at once); prints one JSON line per member: its rank, its requests
per sync, and what each sync decided.
"""

import json
import multiprocessing
import sys

import torch.distributed as dist

from trainaccel.resilience.failfast import LastChange
from trainaccel.resilience.membership import Membership


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


def member(port: int, rank: int, members: int, syncs: int, barrier, results) -> None:
    store = Counting(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False))
    one = object.__new__(Membership)  # what Membership() sets up around a job's default group, without one
    one.members, one.rank, one._world = list(range(members)), rank, members
    one.incarnations = dict.fromkeys(range(members), 0)
    one._store, one._key, one._beats, one._done = store, "scale/members/", LastChange(), []
    one._replica = {r: r for r in range(members)}
    counts, decided = [], []
    barrier.wait()
    for sync in range(syncs):
        before = store.requests
        here = one._roll_call(f"sync{sync}.0", None)
        committed = one._vote(f"sync{sync}.0", True, None)
        counts.append(store.requests - before)
        decided.append([here == list(range(members)), committed])
    results.put({"rank": rank, "requests": counts, "decided": decided})


if __name__ == "__main__":
    port, members, syncs = (int(a) for a in sys.argv[1:4])
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(members), context.Queue()
    procs = [context.Process(target=member, args=(port, r, members, syncs, barrier, results)) for r in range(members)]
    for p in procs:
        p.start()
    got = [results.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    for line in sorted(got, key=lambda g: g["rank"]):
        print(json.dumps(line))
    sys.exit(0 if all(p.exitcode == 0 for p in procs) else 1)
