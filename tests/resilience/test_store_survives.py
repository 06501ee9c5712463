"""The first node lost whole, on 3 nodes x 1 worker (`trainaccel run` per node, on loopback) under
on_lost_replica=continue: with the job's store on a 3-member etcd cluster (`--store etcd://...`), its member on the
lost node killed too, the other two nodes train on and end equal; with torchrun's store in the first node's agent
(the default) they end, naming the store."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from conftest import SCRIPTS, free_port, trainaccel_cmd, watch_launchers
from trainaccel.bench.stores import EtcdCluster

pytestmark = pytest.mark.multiprocess

NODES = 3
DEADLINE_S = 150  # far under the 600 s collective timeout: only the membership can have let them go on


def lose_the_first_node(
    tmp_path, store: EtcdCluster | None, how: str = "first"
) -> tuple[list[int | None], list[str], float]:
    """Every node's exit code and output, and the seconds from the loss to the last launcher's end. `first`: node 0's
    worker kills itself at step 9, then every other process of its node (its `trainaccel run`, and its store member)
    is killed; `first_rejoin`: as `first`, then node 0 and its member are started again (its output appended);
    `store_lost`: at step 5 two of the store's three members are killed, and nobody else."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")}
    on_etcd = ["--store", store.url, "--rdzv-id", "first-node-lost"] if store is not None else []
    logs = [tmp_path / f"node{node}.log" for node in range(NODES)]

    def start(node: int, mode: str = "w") -> subprocess.Popen:
        with open(logs[node], mode) as out:
            command = [
                *trainaccel_cmd(),
                *["run", "--nnodes", str(NODES), "--node-rank", str(node), "--nproc-per-node", "1"],
                *["--master-addr", "127.0.0.1", "--master-port", str(port), *on_etcd],
                *["--sync-every", "4", "--on-lost-replica", "continue"],
                *[str(SCRIPTS / "lost_replica.py"), str(tmp_path), how],
            ]
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=base, start_new_session=True)

    procs = [start(node) for node in range(NODES)]
    began, lost_at, again = time.monotonic(), None, how == "first_rejoin"
    waited = procs if how in ("store_lost", "first_rejoin") else procs[1:]

    def events(tree) -> None:
        nonlocal lost_at, again
        if again and lost_at is not None and not any(node == 0 for _, node in tree.alive()):
            again = False  # node 0 started again with the job's command, and its store member with it
            store.start(0)
            procs[0] = waited[0] = start(0, "a")
        if lost_at is None and (tmp_path / "lost").exists():
            lost_at = time.monotonic()
            if how in ("first", "first_rejoin"):
                for pid, node in tree.alive():
                    if node == 0:
                        os.kill(pid, 9)
                if store is not None:
                    store.kill(0)
            else:
                store.kill(1)
                store.kill(2)

    codes, end = watch_launchers(procs, waited, DEADLINE_S, events)
    ended = end - (lost_at or began)
    assert lost_at is not None, logs[0].read_text()[-3000:]
    return codes, [log.read_text() for log in logs], ended


def test_with_the_store_on_etcd_the_others_outlive_the_first_node_and_end_equal(tmp_path, etcd):
    codes, outputs, _ = lose_the_first_node(tmp_path, etcd)
    said = outputs[1] + outputs[2]
    assert codes[1:] == [0, 0], (codes, said[-3000:])
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (1, 2)]
    assert not (tmp_path / "rank0.json").exists()
    assert [r["members"] for r in results] == [[1, 2], [1, 2]]
    assert [r["syncs"] for r in results] == [6, 6]  # every sync of the 24 steps, none skipped
    assert results[0]["params"] == results[1]["params"]  # the last sync's mean, the same bits on both
    assert "goes on with 2 of 3 replicas, without rank 0" in said, said[-3000:]
    # What rank 0 said of the whole job, the lowest live rank says once rank 0 is lost.
    assert "[trainaccel rank 1] INFO on_lost_replica=continue: DistributedSampler splits the data over the 2" in said
    assert "DistributedSampler splits" not in outputs[2]
    assert "has not answered" not in said


@pytest.mark.resilience_full
def test_with_the_store_in_the_first_nodes_agent_the_others_end_naming_it(tmp_path):
    """What the etcd store is for: by default the store goes with the first node, and the job with it."""
    codes, outputs, _ = lose_the_first_node(tmp_path, None)
    assert 0 not in codes[1:], codes
    for output in outputs[1:]:  # the store's connection closed under a sync's request, or silent for 15 s
        said = [line for line in output.splitlines() if line.startswith("trainaccel: ending rank")]
        assert said and "the job's store (127.0.0.1:" in said[0], output[-3000:]
        assert "is gone" in said[0] or "has not answered for" in said[0], said


@pytest.mark.resilience_full  # CI: the store's own test of a majority lost (test_etcd_store.py)
def test_a_majority_of_the_stores_members_lost_ends_every_worker_naming_the_store(tmp_path, etcd):
    """Two of the three members killed while every node trains: each worker ends within hang_timeout's least (60 s),
    its last word naming the store, and every launcher exits."""
    codes, outputs, ended = lose_the_first_node(tmp_path, etcd, "store_lost")
    assert None not in codes and 0 not in codes, codes
    assert ended < 60, ended
    for output in outputs:
        assert f"the job's store (etcd at {etcd.url.removeprefix('etcd://')})" in output, output[-3000:]
        assert "a majority of" in output, output[-3000:]


@pytest.mark.resilience_full  # CI: the first node lost (above); its rejoin runs as any node's (test_lost_replica.py)
def test_the_first_node_started_again_rejoins_and_every_replica_ends_equal(tmp_path, etcd):
    codes, outputs, _ = lose_the_first_node(tmp_path, etcd, "first_rejoin")
    assert codes == [0, 0, 0], (codes, outputs[0][-3000:])
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(NODES)]
    assert [r["members"] for r in results] == [[0, 1, 2]] * 3
    assert [r["rejoined_at"] for r in results] == [40, 0, 0]
    assert all(r["params"] == results[0]["params"] for r in results)
    assert "this process rejoins it" in outputs[0], outputs[0][-3000:]
