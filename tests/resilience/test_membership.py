"""on_lost_replica=continue in one process: what it refuses, and that a job without losses syncs as under stop."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainaccel
from trainaccel.comm import DiLoCo, OuterSync
from trainaccel.resilience import failfast


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    trainaccel.shutdown()
    dist.destroy_process_group()


def _train(on_lost_replica: str) -> tuple[list[torch.Tensor], DiLoCo]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, optimizer, sync_every=3, outer_optimizer="nesterov", on_lost_replica=on_lost_replica)
    for i in range(9):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(5, 4, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :2]).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], diloco


@pytest.mark.usefixtures("one_rank")
def test_without_a_loss_continue_syncs_as_stop_does():
    stopped, _ = _train("stop")
    trainaccel.shutdown()
    continued, diloco = _train("continue")
    assert diloco.members == [0] and diloco.syncs == 3 and failfast.surviving()
    assert all(torch.equal(a, b) for a, b in zip(stopped, continued))
    trainaccel.shutdown()
    assert not failfast.surviving()  # shutdown() undoes it


@pytest.mark.usefixtures("one_rank")
def test_under_node_scope_a_lost_rank_takes_its_nodes_other_ranks_with_it():
    import json

    from torch.distributed import distributed_c10d

    from trainaccel.resilience.membership import Membership

    membership = Membership(dist.group.WORLD, timeout_s=5.0)
    membership.members, membership._world = list(range(6)), 6  # as on 3 nodes x 2 workers
    membership.group_replicas([[0, 1], [2, 3], [4, 5]])
    store = failfast.root_store(distributed_c10d._get_default_store())
    assert json.loads(store.get(failfast.replicas_key())) == [[0, 1], [2, 3], [4, 5]]  # what a rejoin checks
    # Rank 4 lost, rank 5 present at the roll call: both out, whatever rank 5's own state.
    assert membership._lose_replicas([0, 1, 2, 3, 5], [4]) == ([0, 1, 2, 3], [4, 5])
    assert membership._why_lost_already(5) == "its node's replica is lost with rank 4"
    assert membership._why_lost_already(3) is None
    # Rank 2 lost while rank 3 has not come: rank 3 need not be waited for.
    assert membership._lose_replicas([0, 1], [2]) == ([0, 1], [2, 3])
    membership.group_replicas(None)  # rank scope: each rank a replica of its own
    assert membership._lose_replicas([0, 2], [1]) == ([0, 2], [1])
    assert membership._why_lost_already(0) is None


@pytest.mark.usefixtures("one_rank")
def test_a_node_started_again_is_admitted_only_once_each_of_its_workers_asked():
    from torch.distributed import distributed_c10d

    from trainaccel.resilience.membership import Membership

    membership = Membership(dist.group.WORLD, timeout_s=5.0)
    membership.members, membership._world = [0, 1, 2, 3], 6  # 3 nodes x 2 workers, node 2 lost
    membership.group_replicas([[0, 1], [2, 3], [4, 5]])
    store = failfast.root_store(distributed_c10d._get_default_store())

    def asks(rank: int) -> None:  # a start of `rank` (its incarnation 1) asks to join, as Membership.join does
        store.add(failfast.incarnation_key(rank), 1)
        store.set(f"{failfast.job_prefix()}members/join/{rank}", "1")

    asks(4)
    assert membership._waiting() == {}  # rank 5 has not asked: node 2 cannot train without it
    membership.group_replicas(None)  # rank scope: rank 4 is a replica of its own
    assert membership._waiting() == {4: 1}
    membership.group_replicas([[0, 1], [2, 3], [4, 5]])
    asks(5)
    assert membership._waiting() == {4: 1, 5: 1}


@pytest.mark.usefixtures("one_rank")
def test_a_node_started_again_takes_the_jobs_nodes_from_what_its_members_wrote():
    from trainaccel.comm.topology import discover

    failfast.become_incarnation(1, [[0, 1], [2, 3]])  # as resilience.rejoin does, from the store
    topology = discover()  # no gather over the stand-in default group, no subgroup built on it
    assert topology.nodes == ((0, 1), (2, 3)) and topology.node_index == 0 and topology.why_flat() is None
    assert topology.intra_group is None
    trainaccel.shutdown()
    assert failfast.incarnation() == 0 and failfast.job_replicas() == []  # shutdown() undoes both


@pytest.mark.usefixtures("one_rank")
def test_continue_under_node_scope_builds_on_one_node():
    params = [nn.Parameter(torch.ones(3))]
    outer = OuterSync(params, sync_every=2, scope="node", on_lost_replica="continue")
    assert outer.members == [0] and failfast.surviving()


@pytest.mark.usefixtures("one_rank")
def test_a_sync_that_fails_over_the_same_members_ends_rather_than_retrying_forever():
    from trainaccel.resilience.membership import TRIES, Membership

    tries = []

    def failing(group, members):
        tries.append(members)
        raise RuntimeError("not a lost member: a fault of the exchange itself")

    membership = Membership(dist.group.WORLD, timeout_s=5.0)
    with pytest.raises(RuntimeError, match=f"sync s failed {TRIES} times over the same 1 members; on this rank: "):
        membership.run("s", failing, hang_s=10.0)
    assert tries == [1] * TRIES
    assert membership.run("t", lambda group, members: members * 10, hang_s=10.0) == 10  # the next sync goes on


@pytest.mark.usefixtures("one_rank")
def test_what_would_wait_for_a_lost_replica_at_every_step_is_refused_in_one_line(monkeypatch):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainaccel.comm import diloco

    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    with pytest.raises(ValueError, match="DDP all-reduces its map of used parameters over every worker"):
        diloco.refuse_what_reaches_other_replicas(DDP(net, find_unused_parameters=True), "node")
    diloco.refuse_what_reaches_other_replicas(DDP(net, find_unused_parameters=True), "rank")  # its exchange is off
    synced = nn.Sequential(nn.Linear(4, 8), nn.SyncBatchNorm(8))
    diloco.refuse_what_reaches_other_replicas(synced, "rank")  # one worker: the group is this replica
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # as in a job of two replicas
    with pytest.raises(ValueError, match=r"SyncBatchNorm '1' over ranks \[0, 1\]: .* keep plain BatchNorm"):
        diloco.refuse_what_reaches_other_replicas(synced, "rank")
    # On a worker whose default group is a stand-in (rejoined, or a growing job's), its groups reduce nothing.
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "fake")
    with pytest.raises(ValueError, match=r"SyncBatchNorm '1' on a worker whose default group is a stand-in .* plain"):
        diloco.refuse_what_reaches_other_replicas(synced, "rank")


@pytest.mark.usefixtures("one_rank")
def test_metrics_under_continue_are_each_workers_own_and_pool_over_no_group(monkeypatch):
    from trainaccel.monitor.metrics import StepMeter

    pooled = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pooled.append(a))
    meter = StepMeter(2, process_group=dist.group.WORLD, logs_here=lambda: True)
    meter.step(4)
    record = meter.step(4)
    assert record is not None and record.workers == 1 and pooled == []
    StepMeter(1, process_group=dist.group.WORLD).step(4)
    assert len(pooled) == 2  # pooled where nothing can be lost
