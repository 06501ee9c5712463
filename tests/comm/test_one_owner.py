"""One thread's order per process group: the debug check (trainaccel.comm.owners), and the settings it guards.

Two threads of a rank issuing on one group interleave their collectives in an order that may differ between ranks
(Gloo aborts on a size mismatch; NCCL hangs or sums the wrong tensors). A group's collectives must come from one
thread, directly or as jobs it queued on the engine's communication thread, and directly only once those jobs are
done. The check fails at the first collective that breaks this, so these faults show on the CPU whatever the timing.
"""

import threading

import pytest
import torch
import torch.distributed as dist

from conftest import SCRIPTS, read_ranks, run, run_nodes, trainaccel_cmd
from trainaccel.comm import owners


def _in_thread(fn, name: str = "script-thread") -> BaseException | None:
    caught: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (handed back to the test)
            caught.append(e)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    return caught[0] if caught else None


@pytest.fixture
def checked(one_process_group):
    owners.install()
    yield
    # the isolating fixture's shutdown() removes the check


def test_a_second_thread_on_one_group_fails_naming_both_threads(checked):
    dist.all_reduce(torch.ones(2))
    error = _in_thread(lambda: dist.all_reduce(torch.ones(2)))
    assert isinstance(error, owners.SecondOwner)
    said = "thread 'MainThread' ordered its collectives first (all_reduce) and thread 'script-thread' now issues"
    assert said in str(error) and "ranks [0]" in str(error)


def test_jobs_follow_the_order_of_the_thread_that_queued_them(checked):
    from trainaccel.comm.scheduler import comm_thread

    group = dist.new_group([0])
    release = threading.Event()

    def held() -> torch.Tensor:
        release.wait(10)
        return dist.all_reduce(torch.ones(2), group=group)

    comm_thread().submit(lambda: dist.all_reduce(torch.ones(2), group=group)).wait()  # the main thread's order
    pending = comm_thread().submit(held)
    with pytest.raises(owners.SecondOwner, match="while jobs it queued .* may still be running"):
        dist.all_reduce(torch.ones(2), group=group)  # directly, before its job on the group is done
    release.set()
    pending.wait()
    assert comm_thread().finished(10)  # waited for: direct collectives follow in order
    dist.all_reduce(torch.ones(2), group=group)
    queued_by_another = _in_thread(lambda: comm_thread().submit(lambda: dist.barrier(group=group)).wait())
    assert isinstance(queued_by_another, owners.SecondOwner)
    assert "a job thread 'script-thread' queued now issues barrier" in str(queued_by_another)


def test_each_group_has_its_own_owner(checked):
    other = dist.new_group([0])
    dist.broadcast(torch.ones(2), 0)  # the default group (group=None): the main thread's
    assert _in_thread(lambda: dist.all_reduce(torch.ones(2), group=other)) is None
    assert isinstance(_in_thread(lambda: dist.barrier()), owners.SecondOwner)
    assert [(o[0], o[2]) for o in owners.owners()] == [("MainThread", "broadcast"), ("script-thread", "all_reduce")]
    assert "thread 'MainThread' ordered its collectives first (broadcast)" in str(_in_thread(lambda: dist.barrier()))


def _in_c10d_thread(fn) -> BaseException | None:
    """`fn` on a thread Python did not start, as c10d's own threads run a future's callbacks."""
    import _thread

    done, caught = threading.Event(), []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (handed back to the test)
            caught.append(e)
        done.set()

    _thread.start_new_thread(run, ())
    assert done.wait(30)
    return caught[0] if caught else None


def test_callbacks_of_a_waiting_job_may_issue_a_python_thread_may_not(checked):
    """torch's PowerSGD hook, run as a job, chains its allreduces through c10d callbacks on Gloo's own thread."""
    from trainaccel.comm.scheduler import comm_thread

    group = dist.new_group([0])

    def job() -> list:
        dist.all_reduce(torch.ones(2), group=group)
        seen = []
        with owners.lent():  # as powersgd_reduce waits on the hook's chain
            seen.append(_in_c10d_thread(lambda: dist.all_reduce(torch.ones(2), group=group)))
            seen.append(_in_thread(lambda: dist.all_reduce(torch.ones(2), group=group)))
        seen.append(_in_c10d_thread(lambda: dist.all_reduce(torch.ones(2), group=group)))  # not lent
        return seen

    lent, python_thread, unlent = comm_thread().submit(job).wait()
    assert lent is None
    assert isinstance(python_thread, owners.SecondOwner)
    assert isinstance(unlent, owners.SecondOwner) and "while jobs it queued" in str(unlent)


def test_a_sync_in_flight_holds_up_no_per_step_job_and_a_group_passes_between_threads_in_order(checked):
    """DiLoCo's syncs run on a thread of their own: a per-step job on another group runs while a sync waits; a job
    that declares a group the other thread issued on last runs after that thread's jobs; one that does not is caught."""
    from trainaccel.comm.scheduler import comm_thread, sync_thread

    per_step, synced = dist.new_group([0]), dist.new_group([0])
    release, order = threading.Event(), []

    def slow_sync() -> None:
        release.wait(10)
        dist.all_reduce(torch.ones(2), group=synced)
        order.append("sync")

    pending = sync_thread().submit(slow_sync, groups=(synced,))
    step = comm_thread().submit(lambda: dist.all_reduce(torch.ones(2), group=per_step), groups=(per_step,))
    step.wait()  # ran while the sync waits (on one thread it would wait 10 s, then fail below)
    assert not pending.done()
    # The sync's group, declared: this per-step job runs after the sync, on every rank alike.
    after = comm_thread().submit(lambda: order.append("per-step") or dist.barrier(group=synced), groups=(synced,))
    release.set()
    after.wait()
    assert order == ["sync", "per-step"]
    # A sync runs after the per-step jobs submitted before it: the group passes back.
    release.clear()
    held = sync_thread().submit(lambda: release.wait(10) and dist.all_reduce(torch.ones(2), group=synced))
    # Not declared, a per-step job on the syncs' group could run beside a sync: the check fails one of the two,
    # whichever issues second.
    undeclared = comm_thread().submit(lambda: dist.all_reduce(torch.ones(2), group=synced))
    failed = []
    for job in (undeclared, held):
        release.set()
        try:
            job.wait()
        except owners.SecondOwner as e:
            failed.append(str(e))
    assert len(failed) == 1 and "from two engine threads" in failed[0], failed
    sync_thread().waited(held)  # every sync waited for: the training thread's next per-step job may take the group
    comm_thread().run(lambda: dist.all_reduce(torch.ones(2), group=synced))


def test_shutdown_removes_the_check(checked):
    import trainaccel

    patched = dist.all_reduce
    assert patched.__wrapped__ is not None  # the check's wrapper
    trainaccel.shutdown()
    assert dist.all_reduce is not patched and not owners.active()
    dist.all_reduce(torch.ones(2))
    assert _in_thread(lambda: dist.all_reduce(torch.ones(2))) is None


# -- the settings, on 2 emulated nodes x 2 workers, each a plain DDP script under `trainaccel run` -----------------

SETTINGS = ["find_unused", "sync_bn_global", "sync_bn_node", "two_models", "static_graph"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("scope", ["node", pytest.param("rank", marks=pytest.mark.comm_full)])
def test_sync_every_with_a_warmup_under_every_ddp_setting_has_one_owner_per_group(tmp_path, scope):
    """The case that aborted (node scope, a warm-up, an unused branch): the warm-up's averages went over DDP's own
    group from the engine's thread while DDP all-reduced its unused-parameter map there from the training thread."""
    settings = SETTINGS if scope == "node" else SETTINGS[:-1]  # rank scope refuses static_graph in one line
    procs = run_nodes(
        SCRIPTS / "sync_hazards.py",
        tmp_path,
        ",".join(settings),
        launcher=[*trainaccel_cmd(), "run", "--sync-every", "4", "--sync-scope", scope, "--sync-warmup", "6"],
    )
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-4000:]
        assert "two threads' collectives" not in proc.stdout
    ranks = read_ranks(tmp_path, 4)
    for setting in settings:
        synced = {r[setting]["synced"] for r in ranks}
        assert len(synced) == 1, f"{setting}: the synced models differ"
        if scope == "node":  # a node's workers average their gradients at every step: one replica per node
            for node in ("0", "1"):
                assert len({r[setting]["replica"] for r in ranks if r["node"] == node}) == 1, (setting, node)
        else:  # every worker its own replica: the parameters between syncs differ
            assert len({r[setting]["replica"] for r in ranks}) == 4, setting
    # Communicators per GPU (docs/communication.md): the engine's copy of the job's group, the hierarchy's in-node,
    # gathering and cross-node groups, and the node's group SyncBatchNorm(scope="node") asked for; each built once for
    # all five models.
    for r in ranks:
        node = [0, 1] if r["node"] == "0" else [2, 3]
        other = [ranks.index(r) % 2, ranks.index(r) % 2 + 2]
        assert sorted(r["groups"]) == sorted([[0, 1, 2, 3], node, node, other, node]), r["groups"]
    if scope == "node":  # the syncs on their own thread, over groups the per-step jobs never use
        for r in ranks:
            node = "[0, 1]" if r["node"] == "0" else "[2, 3]"
            other = str([ranks.index(r) % 2, ranks.index(r) % 2 + 2])
            jobs = [q for q in r["queues"] if q[1]]  # (the training thread's own groups have no engine thread)
            sync, comm = "trainaccel-sync", "trainaccel-comm"
            # the job's copy (warm-up and syncs), the node's sum (each step's average), gather and cross-node (syncs)
            want = [["[0, 1, 2, 3]", sync], [node, comm], [node, sync], [other, sync]]
            assert sorted(jobs) == sorted(want), (jobs, r["queues"])


@pytest.mark.multiprocess
def test_the_engines_copies_of_subgroups_are_built_by_every_rank_in_one_order(tmp_path):
    """DDP over data-parallel subgroups: with NCCL and a bound device_id, torch splits each new group from the default
    communicator, which every rank must join in one order; copies built by their members alone would hang there."""
    proc = run([*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 4, SCRIPTS / "subgroup_ddp.py", tmp_path])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ranks = read_ranks(tmp_path, 4)
    assert all(r["built"] == [[[0, 2], False], [[1, 3], False]] for r in ranks), [r["built"] for r in ranks]
    for r in ranks:  # each data-parallel group trained one replica
        assert r["digest"] == ranks[r["members"][0]]["digest"]
    assert ranks[0]["digest"] != ranks[1]["digest"]
