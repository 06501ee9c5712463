"""Low-communication training (sync_every, DiLoCo): exact against DiLoCo by hand, replicas equal at every sync."""

import contextlib
import copy
import functools
import io
import re
import threading
import time
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel
from conftest import SCRIPTS, read_ranks, run_nodes, trainaccel_cmd
from trainaccel.comm import DiLoCo, OuterSync, register, sync_replicas
from trainaccel.config import Config, ConfigError


@pytest.fixture(
    # (fp4 under rank scope goes through the same hierarchy across the 2 nodes as node/fp4/streaming's syncs; CI runs
    # streaming under node scope, where it crosses nodes in two levels, and rank scope without it; node scope without
    # streaming also runs in tests/comm/test_one_owner.py, with a warm-up)
    scope="module",
    params=[
        "rank/none",
        pytest.param("rank/none/streaming", marks=pytest.mark.comm_full),
        pytest.param("node/none", marks=pytest.mark.comm_full),
        "node/fp4/streaming",
    ],
)
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("diloco")
    scope, codec, *streaming = request.param.split("/")
    env = {"TRAINACCEL_SYNC_EVERY": "3", "TRAINACCEL_SYNC_SCOPE": scope, "TRAINACCEL_OUTER_COMPRESSION": codec}
    if streaming:  # 3 fragments, each applied one step after its sync began
        env.update(TRAINACCEL_SYNC_FRAGMENTS="3", TRAINACCEL_SYNC_OVERLAP="1")
    env["TRAINACCEL_OUTER_OPTIMIZER"] = "nesterov"  # the outer rule with state: momentum across syncs and resumes
    procs = run_nodes(SCRIPTS / "diloco.py", out, launcher=[*trainaccel_cmd(), "run"], env=env)
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-4000:]
    return read_ranks(out, 4), "".join(p.stdout for p in procs)


def _node_scope(out: str) -> bool:
    """Whether the run's configuration (logged once by rank 0) had sync_scope=node."""
    found = re.search(r"trainaccel config: .*\bsync_scope=(\w+)", out)  # (the line names what is not a default)
    return found is not None and found.group(1) == "node"


def _assert_averaged_within_nodes_only_under_node_scope(grads: list[str], out: str) -> None:
    """Gradient digests of ranks 0-3: equal within each node (0-1, 2-3) and not across under node scope; all
    different under rank scope."""
    if _node_scope(out):
        assert grads[0] == grads[1] and grads[2] == grads[3] and grads[0] != grads[2]
    else:
        assert len(set(grads)) == 4


@pytest.mark.multiprocess
def test_zero_code_equals_diloco_by_hand(ranks):
    exact = "outer_compression=none" in ranks[1]
    for r in ranks[0]:
        # Inner AdamW on each replica, outer Nesterov on the mean change; fp4 (error feedback) close.
        assert r["exact_err"] <= (1e-6 if exact else 0.1 * r["moved"]), r
        assert r["synced_err"] <= (1e-6 if exact else 0.1 * r["moved"]), r  # state_dict(): the applied anchors
        assert r["exact_err"] > 0 or exact  # (fp4 does round: the check above sees something)
        # An evaluation forward on every rank at every step changed nothing, to the bit.
        assert r["metric_forward_err"] == r["exact_err"], r


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "what",
    [
        "hashes",
        "every_rank_look",
        "after_subset_look",
        "after_skip",
        "after_script_skip",
        "bn/False",
        "bn/True",
        "end_live",
        "end",
        "auto",
        "own_hook",
    ],
)
def test_replicas_are_bitwise_equal_at_every_sync(ranks, what):
    seen = [r[what] for r in ranks[0]]
    assert all(s == seen[0] for s in seen), what
    if what == "hashes":
        # Syncs at 3 and 6, looks at 5 (.eval()) and 8 (state_dict); streaming: replicas are equal at looks only.
        assert [step for step, _ in seen[0]] == ([5, 8] if "sync_fragments=3" in ranks[1] else [3, 5, 6, 8])


@pytest.mark.multiprocess
def test_gradients_are_not_exchanged_across_replicas(ranks):
    _assert_averaged_within_nodes_only_under_node_scope([r["grad"] for r in ranks[0]], ranks[1])


@pytest.mark.multiprocess
def test_a_script_hook_under_node_scope_makes_each_worker_a_replica_and_says_so(ranks):
    results, out = ranks
    assert len({r["own_hook_grad"] for r in results}) == 4  # the script's hook does not run: nothing exchanged
    assert len({r["own_hook"] for r in results}) == 1  # the sync at step 3 averaged all four
    warned = "and the script registered allreduce_hook: every worker is a replica of its own" in out
    assert warned == _node_scope(out)
    # The one-time warning at the start quoted one replica per node's figures: the fallback quotes its own.
    assert ("do not hold; each worker steps on its own gradients between syncs" in out) == _node_scope(out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["sparse", "fp16", "bf16"])
def test_sparse_and_pure_half_models_train_and_agree_at_a_look(ranks, kind):
    results, out = ranks
    assert len({r[f"kind/{kind}"] for r in results}) == 1  # the replicas averaged, bitwise equal on every rank
    assert all(r[f"kind/{kind}/moved"] and r[f"kind/{kind}/finite"] for r in results)
    _assert_averaged_within_nodes_only_under_node_scope([r[f"kind/{kind}/grad"] for r in results], out)  # sparse too


@pytest.mark.multiprocess
def test_with_two_optimizers_the_replicas_are_equal_right_after_each_sync(ranks):
    results, out = ranks
    assert len({r["two_optimizers/look"] for r in results}) == 1
    if re.search(r"trainaccel config: .*\bsync_fragments=(\d+)", out) is None:  # (1, the default)
        # (Streaming's fragments sync at staggered steps: the whole model is equal at looks only.)
        for step in (3, 6):
            assert len({r[f"two_optimizers/{step}"] for r in results}) == 1, step


@pytest.mark.multiprocess
def test_static_graph_trains_under_node_scope(ranks):
    results, out = ranks
    if _node_scope(out):
        assert len({r["static_graph"] for r in results}) == 1


@pytest.mark.multiprocess
def test_a_look_on_rank_0_alone_waits_for_no_one_and_sees_the_synced_model(ranks):
    results, out = ranks
    assert all(r["every_rank_look"] == results[0]["subset_look"] for r in results)  # rank 0's save: the synced model
    assert all(r["barrier_s"] < 5 for r in results), [r["barrier_s"] for r in results]  # plain DDP's: at once
    assert " only, " not in out  # nothing to warn of


@pytest.mark.multiprocess
def test_an_ema_copy_is_its_own_module(ranks):
    for r in ranks[0]:
        assert r["ema_modes"] == [False, True, True] and r["ema_finite"]


@pytest.mark.multiprocess
def test_batchnorm_statistics_are_averaged(ranks):
    assert ranks[0][0]["bn_mean/False"] == ranks[0][0]["bn_mean/True"]  # find_unused_parameters changes nothing


@pytest.mark.multiprocess
def test_kill_and_resume_equals_the_uninterrupted_run(ranks):
    results, out = ranks
    if "sync_fragments=3" not in out:  # (streaming's replicas are never the synced model: each resumes from it)
        for r in results:
            assert r["resume_err"] == 0.0


# -- one process ----------------------------------------------------------------------------------------------


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _by_hand(
    steps: int, every: int, outer: str, fragments: list[list[int]] | None = None, overlap: int = 0
) -> list[torch.Tensor]:
    """One replica by hand: fragment f's outer step every `every` steps from (f + 1) * every / F, applied `overlap`
    steps later with the steps taken meanwhile kept on top."""
    model = _net()
    params = list(model.parameters())
    fragments = fragments or [list(range(len(params)))]
    inner = torch.optim.AdamW(params, lr=0.01)
    anchors = [p.detach().clone() for p in params]
    nesterov = outer == "nesterov"
    outers = [torch.optim.SGD([anchors[i] for i in f], lr=0.7, momentum=0.9, nesterov=nesterov) for f in fragments]
    pending: dict[int, tuple[int, dict]] = {}
    for step in range(1, steps + 1):
        _step(model, inner, step)
        with torch.no_grad():
            for f in [f for f in sorted(pending) if pending[f][0] <= step]:
                _, before = pending.pop(f)
                for i in fragments[f]:
                    params[i].copy_((params[i] - before[i]) + anchors[i])
            for f, indices in enumerate(fragments):
                offset = (f + 1) * every // len(fragments)
                if step < offset or (step - offset) % every:
                    continue
                for i in indices:
                    anchors[i].grad = anchors[i] - params[i]
                if outer == "average":  # one replica: its own parameters are the mean
                    for i in indices:
                        anchors[i].sub_(anchors[i].grad)
                else:
                    outers[f].step()
                pending[f] = (step + overlap, {i: params[i].clone() for i in indices})
                if not overlap:
                    for i in indices:
                        params[i].copy_(anchors[i])
                    del pending[f]
    return [p.detach().clone() for p in params]


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("outer", ["nesterov", "sgd", "average"])
def test_explicit_api_on_a_plain_module_equals_the_outer_rule_by_hand(outer):
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = DiLoCo(model, inner, sync_every=3, outer_optimizer=outer)
    for i in range(1, 8):
        _step(model, inner, i)
    assert diloco.steps == 7 and diloco.syncs == 2
    for got, want in zip(model.parameters(), _by_hand(7, 3, outer)):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("outer", ["nesterov", "sgd"])
@pytest.mark.parametrize("fragments, overlap", [(2, 0), (2, 1), (1, 2), (3, 2), (4, 3), (1, 4), (2, 4)])
def test_streaming_equals_staggered_delayed_outer_steps_by_hand(outer, fragments, overlap):
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = DiLoCo(model, inner, sync_every=4, outer_optimizer=outer, sync_fragments=fragments, sync_overlap=overlap)
    ids = {id(p): i for i, p in enumerate(model.parameters())}
    split = [[ids[id(p)] for p in fragment] for fragment in diloco.fragments]
    assert sorted(i for f in split for i in f) == [0, 1, 2, 3] and all(split)
    for i in range(1, 12):
        _step(model, inner, i)
    assert diloco.syncs == sum(1 + (11 - overlap - (f + 1) * 4 // fragments) // 4 for f in range(fragments))
    for got, want in zip(model.parameters(), _by_hand(11, 4, outer, split, overlap)):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("outer", ["nesterov", "average"])
@pytest.mark.parametrize("fragments, overlap", [(1, 0), (2, 1), (3, 2)])
def test_the_algorithm_alone_driven_by_the_loop_equals_the_outer_rule_by_hand(outer, fragments, overlap):
    """OuterSync without DiLoCo: nothing hooked on the module, the optimizer or torch; the loop calls it."""
    from torch.optim import optimizer as optim_module

    global_hooks = len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks)
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    sync = OuterSync(
        model.parameters(), sync_every=4, outer_optimizer=outer, sync_fragments=fragments, sync_overlap=overlap
    )
    assert not model._forward_pre_hooks and not model._forward_hooks and not model._state_dict_hooks
    assert (
        len(optim_module._global_optimizer_pre_hooks),
        len(optim_module._global_optimizer_post_hooks),
    ) == global_hooks
    ids = {id(p): i for i, p in enumerate(model.parameters())}
    split = [[ids[id(p)] for p in fragment] for fragment in sync.fragments]
    for i in range(1, 12):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        sync.prepare()
        inner.step()
        sync.step()
    assert sync.steps == 11 and sync.syncs == sum(
        1 + (11 - overlap - (f + 1) * 4 // fragments) // 4 for f in range(fragments)
    )
    for got, want in zip(model.parameters(), _by_hand(11, 4, outer, split, overlap)):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)
    with torch.no_grad():
        model(torch.randn(2, 4))  # a look changes nothing: the algorithm alone has no looks
    assert sync.steps == 11


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("how", ["found", "given", "built_before", "stale", "sparse_first"])
def test_with_two_optimizers_an_inner_step_ends_after_both(how):
    """Two AdamW on the two layers are one AdamW on all: the syncs come after both, as DiLoCo by hand with one."""
    model = _net()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    if how == "sparse_first":  # the second layer's optimizer steps first: the order does not matter
        first, second = second, first
    if how == "built_before":  # not seen built: it joins after the first inner step ended, counted in it
        early = torch.optim.AdamW(second, lr=0.01)
    diloco = DiLoCo(model, sync_every=3, outer_optimizer="nesterov") if how != "given" else None
    optimizers = [torch.optim.AdamW(first, lr=0.01)]
    optimizers.append(early if how == "built_before" else torch.optim.AdamW(second, lr=0.01))
    if how == "given":
        diloco = DiLoCo(model, optimizers, sync_every=3, outer_optimizer="nesterov")
    if how == "stale":  # built holding the model, never stepped: the first inner step ends at the second forward
        stale = torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: F841 (alive: its steps would count)
    both = _Both(optimizers)
    for i in range(1, 8):
        _step(model, both, i)
    assert diloco.steps == 7 and diloco.syncs == 2
    for got, want in zip(model.parameters(), _by_hand(7, 3, "nesterov")):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)


@pytest.mark.usefixtures("one_process_group")
def test_an_optimizer_of_the_model_left_out_of_the_given_ones_is_warned_about(trainaccel_messages):
    model = _net()
    given, other = torch.optim.AdamW(model[0].parameters()), torch.optim.AdamW(model[2].parameters())
    DiLoCo(model, [given], sync_every=2)
    for i in range(1, 3):
        _step(model, _Both([given, other]), i)
    warned = [m for m in trainaccel_messages if "that was not given also steps the model's parameters" in m]
    assert len(warned) == 1 and "DiLoCo(model, [opt1, opt2])" in warned[0]


@pytest.mark.usefixtures("one_process_group")
def test_zero_redundancy_optimizer_is_refused_at_its_first_step():
    with warnings.catch_warnings():  # importing it warns of torch.jit's deprecation
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer
    model = _net()
    DiLoCo(model, sync_every=2)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    with pytest.raises(RuntimeError, match="sync_every=2 cannot train with ZeroRedundancyOptimizer: it steps each"):
        _step(model, optimizer, 1)


class _Both:
    """Several optimizers stepped one after the other, as a training loop with two of them does."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def test_fragments_are_contiguous_runs_of_about_equal_size():
    from trainaccel.comm.outer_sync import split_fragments

    def sizes(numels: list[int], count: int) -> list[list[int]]:
        return [[p.numel() for p in run] for run in split_fragments([torch.zeros(n) for n in numels], count)]

    assert sizes([10, 10, 10, 10], 2) == [[10, 10], [10, 10]]
    assert sizes([1000, 1, 1000, 1, 1000, 1], 3) == [[1000, 1], [1000, 1], [1000, 1]]
    assert sizes([100, 1, 1, 1], 3) == [[100], [1], [1, 1]]  # a large first tensor: later runs still non-empty
    assert sizes([1, 1, 1, 100], 3) == [[1, 1], [1], [100]]
    assert sizes([3, 3], 2) == [[3], [3]]


def _live(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _synced(diloco: DiLoCo) -> dict[int, torch.Tensor]:
    return {id(tensor): value for tensor, value in diloco.synced()}


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("at", [3, 4])
@pytest.mark.parametrize("streaming", [{}, {"sync_fragments": 3, "sync_overlap": 1}])
def test_a_checkpoint_holds_the_synced_model_and_resumes_every_replica_from_it(streaming, at):
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = DiLoCo(model, inner, sync_every=3, outer_optimizer="nesterov", **streaming)
    for i in range(1, at + 1):
        _step(model, inner, i)
    live = _live(model)
    saved = copy.deepcopy({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()})
    assert all(torch.equal(p, q) for p, q in zip(_live(model), live))  # saving changed nothing
    synced = _synced(diloco)
    for name, p in model.named_parameters():
        assert torch.equal(saved["model"][name], synced[id(p)])
    whole_sync = not streaming and at == 3  # right after a sync of the whole model, the replica is the synced model
    assert all(torch.equal(saved["model"][n], p) for n, p in zip(saved["model"], live)) == whole_sync
    for i in range(at + 1, 10):
        _step(model, inner, i)
    uninterrupted = _live(model)

    model2 = _net()
    nn.init.zeros_(model2[0].weight)  # a different start: everything must come from the checkpoint
    inner2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    diloco2 = DiLoCo(model2, inner2, sync_every=3, outer_optimizer="nesterov", **streaming)
    model2.load_state_dict(saved["model"])
    inner2.load_state_dict(saved["inner"])
    diloco2.load_state_dict(saved["diloco"])
    for name, p in model2.named_parameters():  # every replica resumes from the synced model
        assert torch.equal(p, saved["model"][name])
    for i in range(at + 1, 10):
        _step(model2, inner2, i)
    # Exact where the replica was the synced model; elsewhere the steps since the last sync were not saved.
    assert all(torch.equal(a, b) for a, b in zip(_live(model2), uninterrupted)) == whole_sync
    with pytest.raises(ValueError, match="taken with sync_every=3, this run has sync_every=4"):
        DiLoCo(_net(), None, sync_every=4, outer_optimizer="nesterov", **streaming).load_state_dict(saved["diloco"])
    other = {"sync_fragments": 2} if streaming else {"sync_overlap": 1}
    with pytest.raises(ValueError, match="taken with sync_(fragments|overlap)=[013], this run has sync_"):
        DiLoCo(_net(), None, sync_every=3, outer_optimizer="nesterov", **{**streaming, **other}).load_state_dict(
            saved["diloco"]
        )


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("streaming", [{}, {"sync_fragments": 2, "sync_overlap": 1}])
def test_looks_see_the_synced_model_send_nothing_and_leave_the_replica_alone(streaming, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, inner, sync_every=3, **streaming)
    for i in range(1, 5):  # a sync at 3; step 4 moves the replica away from the synced model
        _step(model, inner, i)
    live = _live(model)
    sent = diloco.bytes_sent
    reference = copy.deepcopy(model)  # the synced model by hand: a copy (no engine hook acts on it) given its values
    synced = _synced(diloco)
    with torch.no_grad():
        for mine, theirs in zip(
            [*model.parameters(), *model.buffers()], [*reference.parameters(), *reference.buffers()]
        ):
            if id(mine) in synced:
                theirs.copy_(synced[id(mine)])
    assert not all(torch.equal(p, q) for p, q in zip(live, reference.parameters()))  # there is something to see
    x = torch.randn(6, 4)
    looking = monkeypatch.context()
    with looking as patch:  # a look issues no collective: any would raise
        for name in (
            "all_reduce",
            "broadcast",
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "barrier",
        ):
            for owner in (dist, dist.distributed_c10d):
                patch.setattr(owner, name, functools.partial(_no_collective, name))
        _look_at(model, reference, x, live)
    assert diloco.bytes_sent == sent and diloco.steps == 4  # no look sent anything or counted a step
    sync_replicas(model)  # on every rank: the live replicas averaged, now what looks see until training goes on
    assert diloco.bytes_sent > sent
    assert all(torch.equal(model.state_dict()[n], p) for n, p in model.named_parameters())


def _no_collective(name: str, *args, **kwargs):
    if threading.current_thread() is not threading.main_thread():  # a sync started by training, still in flight
        return getattr(_COLLECTIVES, name)(*args, **kwargs)
    raise AssertionError(f"a look called torch.distributed.{name}")


_COLLECTIVES = types.SimpleNamespace(
    **{
        name: getattr(dist.distributed_c10d, name)
        for name in (
            "all_reduce",
            "broadcast",
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "barrier",
        )
    }
)


def _look_at(model: nn.Module, reference: nn.Module, x: torch.Tensor, live: list[torch.Tensor]) -> None:
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # an evaluation forward runs on the synced model
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    model.train()
    with torch.no_grad():  # gradients off in training mode (a GAN's samples): the live replica
        own = copy.deepcopy(model)
        torch.manual_seed(1)  # the same dropout masks
        mine = model(x)
        torch.manual_seed(1)
        assert torch.equal(mine, own(x))
    assert all(torch.equal(p, q) for p, q in zip(_live(model), live))  # the replica is as training left it


@pytest.mark.usefixtures("one_process_group")
def test_a_copy_of_the_module_carries_no_engine():
    """An EMA as reference scripts keep it (`copy.deepcopy(model.module).eval()`), and a pickled module."""
    model = _net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, inner, sync_every=3)
    for i in range(1, 5):
        _step(model, inner, i)
    ema = copy.deepcopy(model)
    ema.eval()
    assert ema.training is False and model.training is True  # the copy's mode, not the original's
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.5).add_(p, alpha=0.5)
    kept = _live(ema)
    assert all(torch.equal(v, p) for v, p in zip(ema.state_dict().values(), kept))  # its own values, not synced ones
    with torch.no_grad():
        ema(torch.randn(2, 4))
    assert all(torch.equal(p, q) for p, q in zip(_live(ema), kept))
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a whole module pickles: its hooks pickle as inert ones
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    steps = diloco.steps
    _step(loaded, torch.optim.SGD(loaded.parameters(), lr=0.1), 5)
    assert diloco.steps == steps  # the copy's training is not this model's


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("codec", ["none", "int8"])
@pytest.mark.parametrize("nan_check", ["off", "warn", "raise"])
def test_nan_check_names_the_parameters_whose_synced_change_is_not_finite(nan_check, codec, trainaccel_messages):
    model = _net()
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    config = Config.resolve(env={}, sync_every=2, nan_check=nan_check, outer_compression=codec)
    diloco = DiLoCo(model, inner, config=config)
    _step(model, inner, 1)
    model[0].bias.register_hook(lambda grad: grad * float("nan"))  # this parameter's gradient alone
    if nan_check == "raise":
        with pytest.raises(FloatingPointError, match=r"at inner step 2 in: 0\.bias \(nan_check=raise\)"):
            _step(model, inner, 2)
    else:
        _step(model, inner, 2)
    warned = [m for m in trainaccel_messages if "non-finite parameter change" in m]
    assert warned == (
        [
            "non-finite parameter change averaged by sync_every=2 at inner step 2 in: 0.bias (nan_check=warn): "
            "a replica stepped on non-finite gradients since the last sync"
        ]
        if nan_check == "warn"
        else []
    )
    assert diloco.syncs == (0 if nan_check == "raise" else 1)


@pytest.mark.usefixtures("one_process_group")
def test_a_skipped_gradscaler_step_counts_as_an_inner_step():
    model = _net()
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    diloco = DiLoCo(model, inner, sync_every=2)
    scaler = torch.amp.GradScaler("cpu")
    for i in range(3):
        inner.zero_grad()
        loss = model(torch.randn(3, 4)).sum() * (float("inf") if i == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(inner)
        scaler.update()
    assert diloco.steps == 3 and diloco.syncs == 1


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("clear", ["optimizer", "module"])
def test_a_step_the_script_skips_counts_as_an_inner_step(clear):
    """`if not torch.isfinite(norm): continue` skips on one replica only: every rank must still count it."""
    model = _net()
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    diloco = DiLoCo(model, inner, sync_every=2)
    for i in range(5):
        (inner if clear == "optimizer" else model).zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        if i == 1:
            continue  # skipped: its gradients are cleared at the next iteration's zero_grad
        inner.step()
        model(torch.randn(3, 4)).sum()  # a forward with gradients on and no backward (an evaluation without no_grad)
        inner.zero_grad()  # ...then cleared: no skipped step
    assert diloco.steps == 5 and diloco.syncs == 2


@pytest.mark.usefixtures("one_process_group")
def test_refusals_are_one_line_naming_the_setting():
    with pytest.raises(ValueError, match=r"invalid sync_every=0; accepted: an integer >= 1, or auto, for DiLoCo"):
        DiLoCo(_net(), None, sync_every=0)
    with pytest.raises(ConfigError, match=r"invalid outer_optimizer='adam'"):
        DiLoCo(_net(), None, sync_every=2, outer_optimizer="adam")
    with pytest.raises(ValueError, match="static_graph=True cannot train under sync_every"):
        DiLoCo(DDP(_net(), static_graph=True), None, sync_every=2)
    net = _net()
    delayed = DDP(
        net, delay_all_reduce_named_params=list(net.named_parameters())[:1], param_to_hook_all_reduce=net[-1].weight
    )
    for scope in ("rank", "node"):
        with pytest.raises(ValueError, match="delay_all_reduce_named_params cannot train under sync_every: DDP all-"):
            DiLoCo(delayed, None, sync_every=2, sync_scope=scope)
    with pytest.raises(ValueError, match="register\\(\\) adds a per-step gradient exchange"):
        register(DDP(_net()), sync_every=2)


@pytest.mark.usefixtures("one_process_group")
def test_a_codec_says_it_does_not_reach_ddps_delayed_parameters(caplog):
    net = _net()
    delayed = list(net.named_parameters())[:2]
    model = DDP(net, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=net[-1].weight)
    with caplog.at_level("WARNING", logger="trainaccel"):
        register(model, compression="fp16", nan_check="warn")
    said = "DDP all-reduces the 2 parameter(s) of delay_all_reduce_named_params itself, uncompressed and unchecked: "
    assert said + "compression=fp16, nan_check=warn and the hierarchy reach the others only" in caplog.text


@pytest.mark.parametrize("option, value", [("compression", "fp16"), ("local_steps", 2), ("autotune", "on")])
def test_per_step_options_are_refused_with_sync_every(option, value):
    with pytest.raises(ConfigError, match=f"invalid {option}=.*with sync_every=5, which switches off"):
        Config.resolve(env={}, sync_every=5, **{option: value})


@pytest.mark.parametrize(
    "option, value, accepted",
    [
        ("sync_every", -1, "an integer >= 0, or auto"),
        ("outer_lr", 0, "a number > 0"),
        ("outer_momentum", 1, r"a number in \[0, 1\)"),
        ("outer_optimizer", "lamb", "average, nesterov, sgd"),
        ("sync_fragments", 0, "an integer >= 1"),
        ("sync_overlap", -1, "an integer >= 0"),
    ],
)
def test_bad_values_are_refused(option, value, accepted):
    with pytest.raises(ConfigError, match=f"accepted: {accepted}"):
        Config.resolve(env={}, **{option: value})


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sync_fragments": 2}, "invalid sync_fragments=2; accepted: 1 without sync_every"),
        ({"sync_overlap": 1}, "invalid sync_overlap=1; accepted: 0 without sync_every"),
        ({"sync_warmup": 5}, "invalid sync_warmup=5; accepted: 0 without sync_every"),
        ({"sync_scope": "node"}, "invalid sync_scope='node'; accepted: auto without sync_every"),
        (
            {"sync_every": 4, "sync_scope": "nodes"},
            r"invalid sync_scope='nodes' \(from keyword\); accepted: auto, node, rank",
        ),
        ({"sync_every": 4, "sync_fragments": 5}, "invalid sync_fragments=5; accepted: at most sync_every=4"),
        ({"sync_every": 4, "sync_overlap": 5}, "invalid sync_overlap=5; accepted: at most sync_every=4"),
    ],
)
def test_streaming_settings_that_cannot_apply_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        Config.resolve(env={}, **options)


@pytest.mark.usefixtures("one_process_group")
def test_more_fragments_than_parameter_tensors_is_refused():
    with pytest.raises(ValueError, match="invalid sync_fragments=5; accepted: at most the model's 4 trainable"):
        DiLoCo(_net(), None, sync_every=8, sync_fragments=5)


@pytest.mark.usefixtures("one_process_group")
def test_shutdown_undoes_everything_it_changed():
    from torch.amp.grad_scaler import GradScaler

    step, destroy = GradScaler.step, dist.destroy_process_group
    trainaccel.init(sync_every=2, start_process_group=False)
    model = DDP(_net())
    hooks = {name: len(getattr(model.module, name)) for name in ("_forward_pre_hooks", "_forward_hooks")}
    assert model.require_backward_grad_sync is False and model.broadcast_buffers is False
    assert "train" not in vars(model.module)  # eval() is not intercepted: a look needs nothing of it
    assert GradScaler.step is not step and dist.destroy_process_group is not destroy
    assert hooks["_forward_pre_hooks"] >= 1 and hooks["_forward_hooks"] >= 1
    trainaccel.shutdown()
    assert model.require_backward_grad_sync is True and model.broadcast_buffers is True
    assert GradScaler.step is step and dist.destroy_process_group is destroy
    assert not model.module._forward_hooks and not model.module._state_dict_hooks


@pytest.mark.parametrize(
    "sync_s, step_s, expected",
    [
        (0.1, 0.1, 9),  # 0.1 / (9 * 0.1 + 0.1) = 10%
        (0.1, 1.0, 1),  # a sync ten times shorter than a step: every step
        (1.0, 0.01, 500),  # capped
        (0.0, 0.1, 1),
        (0.5, 0.0, 500),  # no step time measured: the cap
    ],
)
def test_auto_interval_keeps_syncs_to_a_tenth_of_the_time(sync_s, step_s, expected):
    from trainaccel.comm.outer_sync import interval_for

    assert interval_for(sync_s, step_s) == expected
    if 1 < expected < 500:
        assert sync_s / (expected * step_s + sync_s) <= 0.1 < sync_s / ((expected - 1) * step_s + sync_s)


@pytest.mark.usefixtures("one_process_group")
def test_sync_warmup_keeps_ddps_exchange_for_its_steps_then_steps_alone():
    model = DDP(_net())
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = DiLoCo(model, inner, sync_every=2, sync_warmup=3)
    exchanging = []
    for i in range(1, 8):
        exchanging.append(model.require_backward_grad_sync)
        _step(model, inner, i)
    assert exchanging == [True, True, True, False, False, False, False]
    assert diloco.syncs == 2 and diloco.next_sync == 9  # syncs after steps 5 and 7: the warm-up's 3, then every 2
    with pytest.raises(ValueError, match="sync_warmup=2 needs a DDP model"):
        DiLoCo(_net(), None, sync_every=2, sync_warmup=2)
    resumed = DDP(_net())
    DiLoCo(resumed, torch.optim.AdamW(resumed.parameters()), sync_every=2, sync_warmup=3).load_state_dict(
        diloco.state_dict()
    )
    assert resumed.require_backward_grad_sync is False  # resumed past the warm-up: local steps at once


@pytest.mark.usefixtures("one_process_group")
def test_zero_code_amp_trains_the_autocast_model_under_sync_every():
    """`--amp bf16` and `--sync-every` together: the inner steps are autocast's, the outer steps DiLoCo's."""
    trainaccel.init(sync_every=2, amp="bf16", outer_optimizer="nesterov", start_process_group=False)
    try:
        model = DDP(_net())
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        for i in range(1, 6):
            _step(model, inner, i)
        zero_code = [p.detach().clone() for p in model.parameters()]
    finally:
        trainaccel.shutdown()
    by_hand = _net()
    optimizer = torch.optim.AdamW(by_hand.parameters(), lr=0.01)
    DiLoCo(by_hand, optimizer, sync_every=2, outer_optimizer="nesterov")
    for i in range(1, 6):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = by_hand(x).float()  # as zero-code AMP hands outputs back (torch 2.7's mse_loss backward needs it)
        nn.functional.mse_loss(out, y).backward()
        optimizer.step()
    for got, want in zip(zero_code, by_hand.parameters()):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)
    plain = _by_hand(5, 2, "nesterov")  # the same without autocast: bf16's rounding is what the check sees
    assert max(float((a - b).abs().max()) for a, b in zip(zero_code, plain)) > 1e-4


class _Tied(nn.Module):
    """A language model's shape: the output head shares the input embedding's Parameter (GPT-2's tied weights)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(x))))


def _tied_step(model: nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    x = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(i))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    optimizer.step()


TIED_SETTINGS = {
    "average": {"sync_every": 2},
    "nesterov": {"sync_every": 2, "outer_optimizer": "nesterov"},
    "int8": {"sync_every": 2, "outer_compression": "int8"},
    "streaming": {"sync_every": 2, "sync_fragments": 2, "sync_overlap": 1},
    # Overlapped, the replica moves on after every sync whatever H auto picks from this machine's timings (H=1 on a
    # busy machine would leave the live replica synced after the last step, with nothing for a look to show).
    "auto": {"sync_every": "auto", "sync_overlap": 1},
}


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("how", ["explicit", "zero_code"])
@pytest.mark.parametrize("setting", TIED_SETTINGS)
def test_tied_parameters_stay_tied_in_what_a_look_returns(setting, how, tmp_path):
    """A head sharing the embedding's Parameter is one tensor in state_dict() (safetensors' save_model writes it once
    and load_model accepts it), one Parameter in named_parameters() and in any copy, as under plain DDP."""
    from safetensors.torch import load_model, save_model

    options = TIED_SETTINGS[setting]
    module = _Tied()
    if how == "zero_code":
        trainaccel.init(start_process_group=False, **options)
        model = DDP(module)
        inner = torch.optim.AdamW(model.parameters(), lr=0.05)
        diloco = model.trainaccel.diloco
    else:
        model = module
        inner = torch.optim.AdamW(model.parameters(), lr=0.05)
        diloco = DiLoCo(model, inner, config=Config(**options))
    try:
        for i in range(1, 12):  # past auto's measuring round and a sync; the last step moves the replica on
            _tied_step(model, inner, i)
        assert diloco.syncs >= 1 and not diloco._shows_live()  # a look sees the synced model, not the live one
        synced = _synced(diloco)[id(module.embed.weight)]
        wrapped = "module." if how == "zero_code" else ""
        for state, prefix in ((model.state_dict(), wrapped), (module.state_dict(), "")):
            head, embed = state[f"{prefix}head.weight"], state[f"{prefix}embed.weight"]
            assert head.data_ptr() == embed.data_ptr(), "the tied weights came back as two tensors"
            assert torch.equal(embed, synced)
        shared = dict(module.named_parameters(remove_duplicate=False))
        assert shared["head.weight"] is shared["embed.weight"]
        copied = copy.deepcopy(module)
        assert copied.head.weight is copied.embed.weight
        save_model(module, tmp_path / "model.safetensors")
        fresh = _Tied()
        load_model(fresh, tmp_path / "model.safetensors")  # strict: refuses a key the model does not have
        assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, synced)
    finally:
        trainaccel.shutdown()


class _Slow(nn.Module):
    """A forward of at least `SLOW_S` seconds: a step's time is then known from below."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW_S)
        return self.layer(x)


SLOW_S = 0.02


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("how", ["no_sync", "require_backward_grad_sync"])
def test_auto_times_an_optimizer_step_across_every_backward_it_accumulates(how):
    """Under gradient accumulation (4 backward passes per optimizer step, DDP's no_sync() as Accelerate and the
    Trainer use it, or nanoGPT's require_backward_grad_sync), auto's step is the optimizer step, all 4 passes."""
    micro = 4
    trainaccel.init(sync_every="auto", start_process_group=False)
    try:
        model = DDP(_Slow())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(1, 9):
            for i in range(micro):
                last = i == micro - 1
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + i))
                if how == "no_sync":
                    with contextlib.nullcontext() if last else model.no_sync():
                        (model(x).square().mean() / micro).backward()
                else:
                    model.require_backward_grad_sync = last
                    (model(x).square().mean() / micro).backward()
            optimizer.step()
            optimizer.zero_grad()
        outer = model.trainaccel.diloco.outer
        assert outer.steps == 8  # one inner step per optimizer step, none per backward pass
        timed = outer._timing[1]  # the step times auto chooses from
        assert len(timed) >= 4 and min(timed) >= micro * SLOW_S, timed
        chosen_from = float(re.search(r"step ([0-9.]+) s", outer._auto.setting.why).group(1))
        assert chosen_from >= micro * SLOW_S, outer._auto.setting.why  # what it said it chose from
    finally:
        trainaccel.shutdown()


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("codec", ["int8", "fp4"])
@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
def test_a_checkpoint_during_an_overlapped_sync_keeps_the_residual_from_before_it(codec, pieces, monkeypatch):
    """The in-flight sync's change is not in the saved anchors (every replica resumes from them and syncs it again):
    its encode, which the syncs' thread may already have run, must not be in the saved residuals either (one, or
    one per piece of a change sent in pieces)."""
    from trainaccel.comm import outer_sync
    from trainaccel.comm.scheduler import sync_thread
    from trainaccel.config import Config

    if pieces:
        monkeypatch.setattr(outer_sync, "GATHER_PIECE_ELEMENTS", 256)
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = DiLoCo(model, inner, sync_every=3, sync_overlap=1, config=Config.resolve(outer_compression=codec))
    for i in range(1, 6):
        _step(model, inner, i)
    before = {k: v.clone() for k, v in diloco.outer._feedback.residuals.items()}
    assert len(before) == (1 if not pieces else -(-sum(p.numel() for p in model.parameters()) // 256)) > 0
    _step(model, inner, 6)  # the second sync begins, applied a step later
    assert sync_thread().finished(30) and diloco.outer._fragments[0].pending is not None  # encoded, not applied
    live = diloco.outer._feedback.residuals
    assert any(not torch.equal(live[k], before[k]) for k in before)  # the live ones moved
    saved = diloco.state_dict()["residuals"]
    assert saved.keys() == before.keys() and all(torch.equal(saved[k], before[k]) for k in before)
    _step(model, inner, 7)  # applied: the live residuals are the sync's, and a checkpoint now saves them
    saved = diloco.state_dict()["residuals"]
    assert saved.keys() == live.keys() and all(torch.equal(saved[k], live[k]) for k in live)


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_sync_averages_the_replicas_and_leaves_the_anchors_and_the_outer_state_as_they_were(outer):
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = DiLoCo(model, inner, sync_every=3, outer_optimizer=outer)
    for i in range(1, 6):  # a regular sync at step 3, then two steps of the replica's own
        _step(model, inner, i)
    anchors = [a.clone() for f in diloco.outer._fragments for a in f.anchors]
    outer_state = copy.deepcopy(diloco.state_dict()["outer"])
    live = _live(model)
    diloco.sync()  # one replica: the mean is the replica itself (anchor - (anchor - p): p to a rounding)
    assert all(torch.allclose(p, q, rtol=0, atol=1e-6) for p, q in zip(_live(model), live))
    assert all(torch.equal(a, b) for a, b in zip((a for f in diloco.outer._fragments for a in f.anchors), anchors))
    assert repr(diloco.state_dict()["outer"]) == repr(outer_state)
