"""A job that grows past its starting size, with the job's store on a 3-member etcd cluster: `trainaccel run
--nnodes MIN:MAX` on nodes 0 to MIN-1, then the last node once they train (rank 0 wrote OUT/grow at step 9): it
joins at a sync, takes the model from a live replica, the data is split over the workers present, and all end
equal. `grow`: 3 nodes x 1 worker, a 4th joins; `node_grow`: 2 nodes x 2 workers under node scope, a 3rd joins
whole. (What cannot grow is refused in one line: tests/launch/test_errors.py.)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import SCRIPTS, free_port, trainaccel_cmd, watch_launchers
from trainaccel.bench.stores import EtcdCluster

pytestmark = pytest.mark.multiprocess

DEADLINE_S = 150
SHAPES = {"grow": (3, 1), "node_grow": (2, 2)}  # (nodes that start the job, workers per node); one more node joins
FULL = pytest.mark.resilience_full


def grow(tmp_path, store: EtcdCluster, how: str) -> tuple[list[int | None], list[str]]:
    """The job's first nodes, then its last once rank 0 wrote OUT/grow: each launcher's exit code and output."""
    first, per_node = SHAPES[how]
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")}
    logs = [tmp_path / f"node{node}.log" for node in range(first + 1)]

    def start(node: int) -> subprocess.Popen:
        with open(logs[node], "w") as out:
            command = [
                *trainaccel_cmd(),
                *["run", "--nnodes", f"{first}:{first + 1}", "--node-rank", str(node)],
                *["--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1", "--master-port", str(port)],
                *["--store", store.url, "--rdzv-id", "grows"],
                *["--sync-every", "4", "--on-lost-replica", "continue"],
                *[str(SCRIPTS / "lost_replica.py"), str(tmp_path), how],
            ]
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=base, start_new_session=True)

    procs = [start(node) for node in range(first)]

    def join(tree) -> None:
        if len(procs) == first and (tmp_path / "grow").exists():
            procs.append(start(first))

    codes, _ = watch_launchers(procs, procs, DEADLINE_S, join)
    return codes, [log.read_text() for log in logs[: len(procs)]]


@pytest.mark.parametrize("how", ["grow", pytest.param("node_grow", marks=FULL)])
def test_a_node_joins_a_running_job_and_every_replica_ends_equal(tmp_path, etcd, how):
    first, per_node = SHAPES[how]
    world = (first + 1) * per_node
    joined = list(range(first * per_node, world))
    codes, outputs = grow(tmp_path, etcd, how)
    assert codes == [0] * (first + 1), (codes, [o[-2000:] for o in outputs])
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["members"] for r in results] == [list(range(world))] * world
    # at the round's end where the others waited for it
    assert [r["rejoined_at"] for r in results] == [40 if r in joined else 0 for r in range(world)]
    assert all(r["params"] == results[0]["params"] for r in results)  # the last sync's mean, the same bits on all
    assert [r["syncs"] for r in results] == [12] * world  # a joiner takes the outer state's count
    # The data is split over the workers present: those of the first nodes at the start (none waits for the last
    # node), every worker at the end.
    assert sorted(i for r in results[: first * per_node] for i in r["split"]["before"]) == list(range(60))
    assert sorted(i for r in results for i in r["split"]["after"]) == list(range(60))
    # Its optimizer's momentum is the lowest live replica's at the join, as for a rank started again.
    assert all(results[r]["momentum_at_join"] == results[0]["momentum_at_join"] for r in joined)
    said = f"rank {joined[0]} takes a free place in a job that grows: this process joins it"
    assert said in outputs[first], outputs[first][-3000:]
    # The script's own collective on the default group: refused in one line (the group is a stand-in).
    assert all(r["refused"] and "stand-in" in r["refused"] for r in results), [r["refused"] for r in results]
    if per_node > 1:  # node scope: a node's workers hold one replica, each node its own, between syncs
        assert [r["scope"] for r in results] == ["node"] * world
        live = [r["live"] for r in results]  # after step 46, between the syncs at 44 and 48
        assert live[0] == live[1] and live[2] == live[3] and live[4] == live[5]
        assert live[0] != live[2] != live[4] != live[0]
