"""A rank started again under on_lost_replica=continue: found lost in the job's store, it becomes the rank's next
incarnation and starts a stand-in default group, whose collectives called by the script end with one line; shutdown()
undoes all of it. (The join itself, on emulated nodes: test_lost_replica.py.)"""

import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

import trainaccel
from conftest import free_port
from trainaccel.comm.diloco import refuse_what_reaches_other_replicas
from trainaccel.devices import group_device
from trainaccel.resilience import failfast, rejoin


@pytest.fixture
def job_store(monkeypatch):
    """A job's store, and the environment torchrun gives rank 2 of 3 workers."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "3"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield store
    trainaccel.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("lost", [False, True])
def test_a_rank_found_lost_rejoins_with_a_stand_in_group(job_store, lost):
    if lost:
        job_store.set(failfast.lost_key(2, "trainaccel/0/"), "killed")
    init_process_group, all_reduce = dist.init_process_group, dist.all_reduce
    trainaccel.init(start_process_group=False, sync_every=4, on_lost_replica="continue")
    assert failfast.incarnation() == (1 if lost else 0)
    assert (dist.init_process_group is init_process_group) is not lost
    if not lost:
        return
    assert int(job_store.get(failfast.incarnation_key(2, "trainaccel/0/"))) == 1
    dist.init_process_group("gloo")  # the script's call: no peer answers, the stand-in needs none
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (2, 3, "fake")
    assert group_device() == torch.device("cpu")  # what its syncs' tensors are made on
    with pytest.raises(RuntimeError, match=r"^all_reduce\(\) on the default group: rank 2 rejoined a running job"):
        dist.all_reduce(torch.ones(1))
    with pytest.raises(RuntimeError, match=r"^barrier\(\) on the default group"):
        dist.barrier()
    # A group the script builds over it is a stand-in too: SyncBatchNorm over one would normalise this worker alone.
    group = dist.new_group([2])
    assert dist.get_backend(group) == "fake"
    with pytest.raises(ValueError, match=r"SyncBatchNorm '' on a worker whose default group is a stand-in"):
        refuse_what_reaches_other_replicas(torch.nn.SyncBatchNorm(4, process_group=group), "rank")
    dist.destroy_process_group()
    trainaccel.shutdown()
    assert failfast.incarnation() == 0 and dist.init_process_group is init_process_group
    assert dist.all_reduce is all_reduce


def test_a_later_start_is_the_next_incarnation(job_store):
    """The rank's second start was lost too: the third is incarnation 2, judged by its own lost key."""
    job_store.set(failfast.lost_key(2, "trainaccel/0/"), "killed")
    job_store.add(failfast.incarnation_key(2, "trainaccel/0/"), 1)
    job_store.set(failfast.lost_key(2, "trainaccel/0/", 1), "frozen")
    assert rejoin.prepare_rejoin() == 2
    assert failfast.departed(job_store, "trainaccel/0/", 3) == 0  # its latest start is alive


def test_a_collective_on_another_group_passes(monkeypatch):
    calls = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append(group)
        return "done"

    watched = rejoin._watched("all_reduce", all_reduce)
    assert watched(torch.ones(1)) == "done"  # nothing refused yet
    monkeypatch.setattr(rejoin, "_refusal", ["it holds rank 2"])
    members = object()
    assert watched(torch.ones(1), group=members) == "done" and calls == [None, members]
    with pytest.raises(RuntimeError, match="all_reduce"):
        watched(torch.ones(1))


@pytest.mark.parametrize("caller", ["my_train", "accelerate.utils.operations", "trainaccel.horovod.ops"])
@pytest.mark.parametrize("steps", ["ddp", "inner"])
def test_the_scripts_collectives_pass_while_it_sets_up_and_are_refused_in_training(monkeypatch, caller, steps):
    """Under on_lost_replica=continue, before any loss: a collective the script (or its framework, or the Horovod API
    for it) calls on the default group passes while it sets up, and ends with one line from its first training step
    on: a DDP model's first step (`ddp`), or the first inner step where no DDP model is observed (`inner`)."""
    watched = rejoin._watched("all_gather", lambda tensors, tensor, group=None, async_op=False: "done")
    call = eval("lambda: watched([], torch.ones(1))", {"__name__": caller, "watched": watched, "torch": torch})
    step = [0]
    monkeypatch.setattr(rejoin, "process_step", lambda: step[0])
    monkeypatch.setattr(rejoin, "_began", [])
    assert call() == "done"
    if steps == "ddp":
        step[0] = 1
    else:
        rejoin.training_began()
    with pytest.raises(RuntimeError) as refused:
        call()
    line = str(refused.value)
    assert line.startswith(f"all_gather() on the default group: called by {caller} in training, where a lost replica ")
    assert "sync_every with on_lost_replica=continue" in line
    assert ("Hugging Face's Trainer" in line) == caller.startswith("accelerate.")
    assert ("hvd collective" in line) == caller.startswith("trainaccel.horovod")


def test_trainaccels_own_collectives_pass_in_training(monkeypatch):
    watched = rejoin._watched("all_reduce", lambda tensor, op=None, group=None, async_op=False: "done")
    monkeypatch.setattr(rejoin, "_began", [True])
    for caller in ("trainaccel.comm.outer_sync", "torch.distributed.distributed_c10d"):
        call = eval("lambda: watched(torch.ones(1))", {"__name__": caller, "watched": watched, "torch": torch})
        assert call() == "done"


def _beat(store, rank, prefix="trainaccel/0/", at=None):
    store.set(f"{prefix}heartbeat/{rank}", json.dumps({"time": time.time() if at is None else at, "step": 1}))


def _train_on(store, ranks, beats=10, every_s=0.3):
    """`ranks` train on: their heartbeats move."""
    for _ in range(beats):
        time.sleep(every_s)
        for rank in ranks:
            _beat(store, rank)


def test_a_worker_its_agent_restarted_rejoins_the_others_earlier_attempt(job_store, monkeypatch):
    """Node 2's agent restarted its worker (torchrun's attempt 1) while ranks 0 and 1 train on at attempt 0."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("GROUP_RANK", "2")
    for rank in (0, 1):
        _beat(job_store, rank)
    job_store.set(failfast.lost_key(2, "trainaccel/0/"), "killed")
    threading.Thread(target=_train_on, args=(job_store, (0, 1)), daemon=True).start()
    assert rejoin.prepare_rejoin() == 1
    assert failfast.job_prefix() == "trainaccel/0/" and failfast.own_attempt() == 1  # the others' keys, from now
    assert job_store.get(failfast.rejoined_attempt_key(1, 2)) == b"0"  # for its agent's exit barrier
    assert int(job_store.get(failfast.incarnation_key(2, "trainaccel/0/"))) == 1
    trainaccel.shutdown()
    assert failfast.job_prefix() == "trainaccel/1/"


def test_a_restarted_worker_waits_for_the_others_to_drop_its_last_start(job_store, monkeypatch):
    """Its agent was quicker than the others' next sync: it waits for their verdict, then rejoins."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _beat(job_store, 2, at=time.time() - 1)  # its last start's last beat
    for rank in (0, 1):
        _beat(job_store, rank)

    def the_others_sync():
        for _ in range(3):
            time.sleep(0.5)
            for rank in (0, 1):
                _beat(job_store, rank)  # they train on
        job_store.set(failfast.lost_key(2, "trainaccel/0/"), "no heartbeat")

    threading.Thread(target=the_others_sync, daemon=True).start()
    assert rejoin.prepare_rejoin() == 1 and failfast.job_prefix() == "trainaccel/0/"


@pytest.mark.parametrize("lost_before", [False, True])
def test_a_wholly_restarted_job_starts_afresh(job_store, monkeypatch, lost_before):
    """Every node's agent restarted its workers: the last attempt's heartbeats stand still, so no job is rejoined,
    even where that attempt had left this rank out before it ended."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(rejoin, "STILL_S", 0.5)
    for rank in (0, 1, 2):
        _beat(job_store, rank)
    if lost_before:
        job_store.set(failfast.lost_key(2, "trainaccel/0/"), "killed")
    assert rejoin.prepare_rejoin() == 0
    assert failfast.job_prefix() == "trainaccel/1/"


def test_a_second_start_of_a_rank_still_training_ends_with_one_line(job_store):
    for rank in (0, 1, 2):
        _beat(job_store, rank)

    threading.Thread(target=_train_on, args=(job_store, (0, 1, 2), 20), daemon=True).start()
    with pytest.raises(RuntimeError, match=r"^rank 2 is already training in this job \(its heartbeat goes on\)"):
        rejoin.prepare_rejoin()
    assert failfast.incarnation() == 0
