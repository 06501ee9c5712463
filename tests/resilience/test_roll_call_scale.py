"""The roll call at scale: a sync costs each member a few store requests, whatever the number of members.

64 processes (one per member, as on 8 nodes of 8 GPUs) run the roll call and the vote of three syncs against one
TCPStore, each through a proxy that counts its requests (tests/scripts/roll_call.py). Polling each member's key every
50 ms, as the roll call once did, costs every member at least 63 requests per decision, and 64 ranks some 80,000 a
second while one is late.
"""

import json
import statistics
import sys

import pytest
import torch.distributed as dist

from conftest import SCRIPTS, run

MEMBERS = 64
SYNCS = 3
# Per member and sync: its roll call (is it lost already, here, count, wait, read) and its vote (the same but the
# first): 9, plus the decision the last to come writes (and the votes it reads in one request).
FEW = 12


@pytest.mark.multiprocess
def test_a_sync_costs_each_of_64_members_a_few_store_requests():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    proc = run([sys.executable, SCRIPTS / "roll_call.py", server.port, MEMBERS, SYNCS], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [g["rank"] for g in got] == list(range(MEMBERS))
    assert all(g["decided"] == [[True, True]] * SYNCS for g in got)
    counts = [c for g in got for c in g["requests"]]
    # The median member's requests; a member descheduled past a look (LOOK_S) reads every member's key once more.
    assert statistics.median(counts) <= FEW, sorted(counts)
    assert sum(c <= FEW for c in counts) >= 0.9 * len(counts), sorted(counts)
