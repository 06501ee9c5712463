"""One issuing thread per process group: the debug check (trainaccel.comm.owners), and the settings it guards.

Two threads of a rank issuing on one group interleave their collectives in an order that may differ between ranks
(Gloo aborts on a size mismatch; NCCL hangs or sums the wrong tensors). The check fails at the second thread's first
collective, so these faults show on the CPU whatever the timing.
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
    assert "thread 'MainThread' issued all_reduce and thread 'script-thread' now issues all_reduce" in str(error)
    assert "ranks [0]" in str(error)


def test_each_group_has_its_own_owner(checked):
    other = dist.new_group([0])
    dist.broadcast(torch.ones(2), 0)  # the default group (group=None): the main thread's
    assert _in_thread(lambda: dist.all_reduce(torch.ones(2), group=other)) is None
    assert isinstance(_in_thread(lambda: dist.barrier()), owners.SecondOwner)
    assert [(o[0], o[2]) for o in owners.owners()] == [("MainThread", "broadcast"), ("script-thread", "all_reduce")]


def test_callbacks_of_a_waiting_owner_may_issue_a_python_thread_may_not(checked):
    dist.all_reduce(torch.ones(2))
    group = dist.group.WORLD

    def chained() -> None:
        # A c10d future's callback runs on Gloo's own thread: what torch's PowerSGD hook chains its allreduces in.
        fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
        fut.then(lambda _: dist.all_reduce(torch.ones(2), group=group)).wait()

    with owners.lent():
        chained()
        assert isinstance(_in_thread(lambda: dist.all_reduce(torch.ones(2))), owners.SecondOwner)
    with pytest.raises(RuntimeError, match="two threads issue collectives"):
        _fail_if_callbacks_issue_unlent(chained)


def _fail_if_callbacks_issue_unlent(chained) -> None:
    # Without lent(), the callback's collective is a second thread's (the error reaches wait() through the future).
    dist.all_reduce(torch.ones(2))
    fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    fut.then(lambda _: dist.all_reduce(torch.ones(2))).wait()


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
@pytest.mark.parametrize("scope", ["node", "rank"])
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
        assert "two threads issue collectives" not in proc.stdout
    ranks = read_ranks(tmp_path, 4)
    for setting in settings:
        synced = {r[setting]["synced"] for r in ranks}
        assert len(synced) == 1, f"{setting}: the synced models differ"
        if scope == "node":  # a node's workers average their gradients at every step: one replica per node
            for node in ("0", "1"):
                assert len({r[setting]["replica"] for r in ranks if r["node"] == node}) == 1, (setting, node)
        else:  # every worker its own replica: the parameters between syncs differ
            assert len({r[setting]["replica"] for r in ranks}) == 4, setting


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
