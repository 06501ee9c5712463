"""A job that grows past its starting size: 3 nodes x 1 worker started with `trainaccel run --nnodes 3:4` and the
job's store on a 3-member etcd cluster, a 4th node started with node rank 3 once they train: it joins at a sync,
takes the model from a live replica, the data is split over the 4, and all end equal. (What cannot grow is refused
in one line: tests/launch/test_errors.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from conftest import SCRIPTS, free_port, trainaccel_cmd
from trainaccel.bench.faults import ProcessTree
from trainaccel.bench.stores import EtcdCluster

pytestmark = pytest.mark.multiprocess

FIRST, MOST = 3, 4
DEADLINE_S = 150


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster(tmp_path / "etcd")
    yield cluster
    cluster.close()


def grow(tmp_path, store: EtcdCluster) -> tuple[list[int | None], list[str]]:
    """Nodes 0-2 of `--nnodes 3:4`, then node 3 once rank 0 wrote OUT/grow (step 9): each launcher's exit code and
    output."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")}
    logs = [tmp_path / f"node{node}.log" for node in range(MOST)]

    def start(node: int) -> subprocess.Popen:
        with open(logs[node], "w") as out:
            command = [
                *trainaccel_cmd(),
                *["run", "--nnodes", f"{FIRST}:{MOST}", "--node-rank", str(node), "--nproc-per-node", "1"],
                *["--master-addr", "127.0.0.1", "--master-port", str(port)],
                *["--store", store.url, "--rdzv-id", "grows"],
                *["--sync-every", "4", "--on-lost-replica", "continue"],
                *[str(SCRIPTS / "lost_replica.py"), str(tmp_path), "grow"],
            ]
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=base, start_new_session=True)

    procs = [start(node) for node in range(FIRST)]
    tree = ProcessTree([proc.pid for proc in procs])
    began = time.monotonic()
    try:
        while any(proc.poll() is None for proc in procs) and time.monotonic() - began < DEADLINE_S:
            tree.scan()
            if len(procs) == FIRST and (tmp_path / "grow").exists():
                procs.append(start(FIRST))
                tree.roots.append(procs[-1].pid)
            time.sleep(0.2)
        codes = [proc.poll() for proc in procs]
    finally:
        tree.scan()
        tree.kill()
        for proc in procs:
            proc.wait(timeout=30)
    return codes, [log.read_text() for log in logs[: len(procs)]]


def test_a_fourth_node_joins_a_job_of_three_and_every_replica_ends_equal(tmp_path, etcd):
    codes, outputs = grow(tmp_path, etcd)
    assert codes == [0] * MOST, (codes, [o[-2000:] for o in outputs])
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(MOST)]
    assert [r["members"] for r in results] == [[0, 1, 2, 3]] * MOST
    assert [r["rejoined_at"] for r in results] == [0, 0, 0, 40]  # at the round's end where the others waited for it
    assert all(r["params"] == results[0]["params"] for r in results)  # the last sync's mean, the same bits on all
    assert [r["syncs"] for r in results[:FIRST]] == [12] * FIRST
    # The data is split over the workers present: 3 at the start (none waits for the 4th), 4 at the end.
    assert sorted(i for r in results[:FIRST] for i in r["split"]["before"]) == list(range(60))
    assert sorted(i for r in results for i in r["split"]["after"]) == list(range(60))
    # Its optimizer's momentum is the lowest live replica's at the join, as for a rank started again.
    assert results[3]["momentum_at_join"] == results[0]["momentum_at_join"]
    assert "rank 3 takes a free place in a job that grows: this process joins it" in outputs[3], outputs[3][-3000:]
    # The script's own collective on the default group: refused in one line (the group is a stand-in).
    assert all(r["refused"] and "stand-in" in r["refused"] for r in results), [r["refused"] for r in results]
