"""on_lost_replica=continue on 3 emulated nodes x 1 worker (`trainaccel run` per node): rank 2 is lost, the others
train on to the end over the replicas present (scripts/lost_replica.py), and end with equal parameters; on 3 nodes x 2
workers under sync_scope=node, node 2's two workers are lost together, and rejoin together."""

import json
import os
import subprocess

import pytest

from conftest import SCRIPTS, free_port, trainaccel_cmd, watch_launchers

pytestmark = pytest.mark.multiprocess

NODES = 3
REJOINS = ("rejoin", "agent", "node_rejoin", "node_agent")  # node 2 started again (by the test or its launcher)
NODE_SCOPE = ("node", "node_freeze", "node_rejoin", "node_agent")  # 3 nodes x 2 workers, sync_scope=node
# trainaccel run's options make the script's DDP model (or its hvd.DistributedOptimizer) DiLoCo
ZERO_CODE = ("zero_code", "horovod", *NODE_SCOPE, *REJOINS)
STARTED_AGAIN = ("rejoin", "node_rejoin")  # node 2's trainaccel run started anew by the test once it ended
DEADLINE_S = 150  # far under the 600 s collective timeout: only the membership can have let them go on


def launch(tmp_path, how: str) -> tuple[list[dict], list[str], list[int | None]]:
    """The job, until both survivors' launchers ended (or DEADLINE_S); every process of every node is ended after.
    Returns the survivors' results, each node's output and each node's `trainaccel run` exit code (None: alive).
    `rejoin`, `node_rejoin`: node 2 is started again once its first `trainaccel run` ended; then its results are
    returned too, and its second start's output and exit code stand for the node. `agent`, `node_agent`: node 2's
    `trainaccel run --max-restarts 1` starts its workers again itself; their results are returned too."""
    port = free_port()
    per_node = 2 if how in NODE_SCOPE else 1
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")}
    logs = [tmp_path / f"node{node}.log" for node in range(NODES)]
    procs = []

    def start(node: int, log) -> subprocess.Popen:
        with open(log, "w") as out:
            command = [
                *trainaccel_cmd(),
                *["run", "--nnodes", str(NODES), "--node-rank", str(node), "--nproc-per-node", str(per_node)],
                *["--master-addr", "127.0.0.1", "--master-port", str(port)],
                *(["--sync-every", "4", "--on-lost-replica", "continue"] if how in ZERO_CODE else []),
                *(["--max-restarts", "1"] if how in ("agent", "node_agent") and node == 2 else []),
                *[str(SCRIPTS / "lost_replica.py"), str(tmp_path), how],
            ]
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=base, start_new_session=True)

    procs = [start(node, log) for node, log in enumerate(logs)]
    waited = procs if how in REJOINS else procs[:2]
    results = [tmp_path / f"rank{r}.json" for r in range((NODES if how in REJOINS else 2) * per_node)]

    def again(tree) -> None:
        if how in STARTED_AGAIN and procs[2].poll() is not None and len(logs) == NODES:
            logs.append(tmp_path / "node2-again.log")  # its first start ended (its rank was killed): again
            procs[2] = start(2, logs[-1])

    # The survivors' launchers end on their own: their exit barrier does not wait for the lost node's agent.
    codes, _ = watch_launchers(procs, waited, DEADLINE_S, again, every_s=0.5)
    outputs = [log.read_text() for log in logs]
    assert all(r.exists() for r in results), "\n".join(o[-3000:] for o in outputs)
    if how in STARTED_AGAIN:
        outputs = [*outputs[:2], outputs[2] + outputs[3]]
    return [json.loads(r.read_text()) for r in results], outputs, codes


FULL = pytest.mark.resilience_full  # outside CI's subset (tests/conftest.py)
SAMPLES = 60  # the script's DistributedSampler


def assert_split(results: list[dict], when: str, workers: int) -> None:
    """The workers' passes over the job-wide sampler (`before` training, or `after`) split it over `workers`: equal
    disjoint parts in rank order that cover every index."""
    parts = [r["split"][when] for r in results]
    each = SAMPLES // workers
    assert parts == [list(range(i, SAMPLES, workers)) for i in range(workers)], (when, parts)
    assert len(parts) == workers and all(len(part) == each for part in parts)


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("kill", marks=FULL),  # CI: the rejoin case below loses rank 2 the same way first
        pytest.param("zero_code", marks=FULL),  # CI: the node case below is zero-code too
        pytest.param("mid_sync", marks=FULL),
        pytest.param("error", marks=FULL),
        pytest.param("freeze", marks=FULL),
        pytest.param("auto", marks=FULL),
        pytest.param("horovod", marks=FULL),  # CI: the unit tests of the Horovod API's refusal (test_rejoin.py)
    ],
)
def test_the_others_train_on_without_a_lost_replica_and_end_equal(tmp_path, how):
    (first, second), outputs, codes = launch(tmp_path, how)
    assert codes[:2] == [0, 0], (codes, outputs[0][-2000:])
    assert first["members"] == second["members"] == [0, 1]
    if how != "auto":  # auto's interval follows the measured times
        assert first["syncs"] == second["syncs"] == 6  # every sync of the 24 steps, none skipped
    else:
        assert first["syncs"] == second["syncs"] >= 2
    assert first["params"] == second["params"]  # the last sync's mean, the same bits on both
    assert not (tmp_path / "rank2.json").exists()
    for result in (first, second):
        assert sum(result["losses"][-4:]) < 0.5 * sum(result["losses"][:4]), result["losses"]
    # The job's sampler: 3 parts before the loss; after it the two survivors share rank 2's part.
    assert [r["split"]["before"] for r in (first, second)] == [list(range(i, SAMPLES, 3)) for i in (0, 1)]
    assert_split([first, second], "after", 2)
    said = outputs[0] + outputs[1]
    assert "goes on with 2 of 3 replicas, without rank 2" in said, said[-3000:]
    assert "each step now reads the batches of 2 workers, not 3, unless the script draws its global batch" in said
    assert "ending rank 0" not in said and "ending rank 1" not in said
    if how != "horovod":
        assert said.count("holding a lost replica's process instead of shutting them down") == 2, said[-3000:]
    if how == "kill":
        for result in (first, second):
            assert result["refused"].startswith(
                "barrier() on the default group: it holds rank 2, which the replicas went on without at sync "
            ), result["refused"]
    if how == "horovod":  # the Horovod API's collective is the script's: refused in training, before the loss
        for result in (first, second):
            assert result["refused"].startswith("all_reduce() on the default group: called by trainaccel.horovod."), (
                result["refused"]
            )
            assert "hvd collective" in result["refused"]


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("node", marks=FULL),  # CI: the node rejoin case below loses node 2 the same way first
        pytest.param("node_freeze", marks=FULL),
    ],
)
def test_under_node_scope_a_nodes_workers_are_lost_together_and_the_other_nodes_end_equal(tmp_path, how):
    """3 nodes x 2 workers, zero-code (sync_scope auto: node); rank 4 is killed (its launcher then ends rank 5) or
    frozen (rank 5 waits in their node's gradient exchange): rank 5 is lost with it, and nodes 0 and 1 train on as two
    replicas."""
    results, outputs, codes = launch(tmp_path, how)
    assert codes[:2] == [0, 0], (codes, outputs[0][-2000:])
    assert [r["scope"] for r in results] == ["node"] * 4
    assert [r["members"] for r in results] == [[0, 1, 2, 3]] * 4
    assert [r["syncs"] for r in results] == [6] * 4  # every sync of the 24 steps, none skipped
    for r in results:  # in two levels over the nodes present: each worker sends its shard across, not the whole
        assert r["sent_per_sync"] < 0.6 * r["model_bytes"], (r["sent_per_sync"], r["model_bytes"])
    assert all(r["params"] == results[0]["params"] for r in results)
    assert not (tmp_path / "rank4.json").exists() and not (tmp_path / "rank5.json").exists()
    assert [r["split"]["before"] for r in results] == [list(range(i, SAMPLES, 6)) for i in range(4)]
    assert_split(results, "after", 4)  # node 2's two parts shared by the four workers present
    said = outputs[0] + outputs[1]
    assert "goes on with 2 of 3 replicas, without rank 4: " in said, said[-3000:]
    assert (
        "; rank 5: its node's replica is lost with rank 4; each step now reads the batches of 4 workers, not 6" in said
    )
    if how == "node_freeze":  # alive, in its node's exchange with the frozen rank: it learns from the store
        ending = "ending rank 5: the other replicas went on without it: its node's replica is lost with rank 4\n"
        assert ending in outputs[2], outputs[2][-3000:]


@pytest.mark.parametrize("how", ["node_rejoin", pytest.param("node_agent", marks=FULL)])
def test_under_node_scope_a_node_started_again_rejoins_whole_and_every_replica_ends_equal(tmp_path, how):
    """3 nodes x 2 workers, zero-code (sync_scope auto: node): rank 4 is killed, node 2 is lost as one replica, then
    started again (`node_rejoin`: its `trainaccel run` anew; `node_agent`: its workers by that launcher,
    `--max-restarts 1`): both its workers rejoin at the same round's end, average their gradients with each other at
    every step over a group of their own, and every replica ends equal."""
    results, outputs, codes = launch(tmp_path, how)
    assert codes == [0, 0, 0], (codes, outputs[2][-3000:])
    assert [r["scope"] for r in results] == ["node"] * 6
    assert [r["members"] for r in results] == [[0, 1, 2, 3, 4, 5]] * 6
    assert [r["rejoined_at"] for r in results] == [0, 0, 0, 0, 40, 40]  # the round's end after both came
    assert [r["syncs"] for r in results] == [12] * 6  # the rejoined took the outer state's count
    for r in results[:4]:  # in two levels over the nodes present, before the loss, after it and after the join
        assert r["sent_per_sync"] < 0.6 * r["model_bytes"], (r["sent_per_sync"], r["model_bytes"])
    joined = results[0]["momentum_at_join"]  # rank 0's momentum as it sent it: the rejoined's optimizers start there
    assert joined is not None and results[4]["momentum_at_join"] == results[5]["momentum_at_join"] == joined
    assert all(r["params"] == results[0]["params"] for r in results)  # the last sync's mean, the same bits on all
    live = [r["live"] for r in results]  # after step 46, between the syncs at 44 and 48
    assert live[0] == live[1] and live[2] == live[3] and live[4] == live[5]  # a node's workers: one replica
    assert live[0] != live[2] != live[4] != live[0]  # each node's replica its own between syncs
    said = outputs[0] + outputs[1]
    assert "goes on with 2 of 3 replicas, without rank 4: " in said, said[-3000:]
    assert (
        "; rank 5: its node's replica is lost with rank 4; each step now reads the batches of 4 workers, not 6" in said
    )
    assert "join@40: rank(s) 4, 5 rejoin the 2 replicas" in said, said[-3000:]
    # destroy_process_group() aborts the groups holding node 2's first start (NCCL's shutdown would wait on it)
    assert said.count("process group(s) holding a lost replica's process instead of shutting them down") == 4, said
    assert outputs[2].count("this process rejoins it") == 2, outputs[2][-3000:]
    assert_split(results, "before", 6)  # node 2's second start: its workers' parts, from the job's split
    assert_split(results, "after", 6)  # every node back: the job's split again
    for result in results[:4]:  # the default group still holds node 2's first start: the script's barrier
        assert result["refused"].startswith("barrier() on the default group: it holds rank 4, 5, which the replicas")
    for rank in (4, 5):
        assert results[rank]["refused"].startswith(f"barrier() on the default group: rank {rank} rejoined a running")


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("rejoin", marks=FULL),  # CI: the node rejoin case, zero-code, runs the same path on 2 x workers
        pytest.param("agent", marks=FULL),
    ],
)
def test_a_replica_started_again_rejoins_and_every_replica_ends_equal(tmp_path, how):
    """`rejoin`: node 2's `trainaccel run` started anew with the same command; `agent`: its worker restarted by its
    own launcher (`--max-restarts 1`, torchrun's attempt 1) while the others go on at attempt 0."""
    (first, second, third), outputs, codes = launch(tmp_path, how)
    assert codes == [0, 0, 0], (codes, outputs[2][-3000:])
    assert first["members"] == second["members"] == third["members"] == [0, 1, 2]
    assert first["rejoined_at"] == second["rejoined_at"] == 0
    assert third["rejoined_at"] == 40  # the round's end after it came (the others waited for it at step 40)
    assert first["params"] == second["params"] == third["params"]  # the last sync's mean, the same bits on all
    assert first["syncs"] == second["syncs"] == 12  # every sync of the 48 steps, none skipped
    assert third["syncs"] == 12  # the outer state it took counts the syncs before it came
    assert third["momentum_at_join"] == first["momentum_at_join"]  # its optimizer went on from rank 0's, not zero
    said = outputs[0] + outputs[1]
    assert "goes on with 2 of 3 replicas, without rank 2" in said, said[-3000:]
    assert "join@40: rank(s) 2 rejoin the 2 replicas" in said, said[-3000:]
    assert "this process rejoins it" in outputs[2], outputs[2][-3000:]
    assert_split([first, second, third], "after", 3)  # rank 2 back: the job's split again
    for result in (first, second):  # the default group still holds rank 2's first start: the script's barrier
        assert result["refused"].startswith("barrier() on the default group: it holds rank 2, which the replicas went")
    assert third["refused"].startswith("barrier() on the default group: rank 2 rejoined a running job")
    for output in outputs:  # the store's host left only once every agent had seen the end: no store call failed
        assert "recvValue failed" not in output, output[-3000:]
