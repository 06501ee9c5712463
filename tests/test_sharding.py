"""Sharding: which blocks are sharded, what is refused, and DDP scripts trained sharded with no code change."""

import contextlib
import json
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import trainaccel
from conftest import SCRIPTS, read_ranks, run, run_nodes, torchrun_cmd, trainaccel_cmd
from trainaccel import Config, ConfigError
from trainaccel.sharding import OLDEST_TORCH, ShardedDataParallel, ShardError, blocks, native_state_dicts, shard

# Below sharding's floor every sharded run is refused in one line (test_a_torch_older_than_shardings_floor_...).
pytestmark = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < OLDEST_TORCH,
    reason=f"shard needs torch {'.'.join(map(str, OLDEST_TORCH))} or later; this torch is refused in one line",
)


def mlp(*widths):
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def test_blocks_are_found_bottom_up_by_size():
    model = torch.nn.Sequential(mlp(100, 100, 100), torch.nn.Linear(100, 100), torch.nn.Linear(100, 2))
    assert [name for name, _ in blocks(model, 10_000)] == ["0.0", "0.2", "1"]  # 10100 each; the head stays at the root
    assert [name for name, _ in blocks(model, 20_000)] == ["0"]  # two layers together; the others are too small
    assert blocks(model, 10**9) == []


def test_what_cannot_be_sharded_is_refused_with_one_line():
    tied = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 1000, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(ShardError, match=r"cannot shard '0' on its own: its parameter is also '1.weight' \(tied\)"):
        blocks(tied, 10_000)
    assert blocks(tied, 10**6) == []  # one unit at the root holds both: nothing to refuse
    sparse = torch.nn.Sequential(torch.nn.EmbeddingBag(100, 8, sparse=True), torch.nn.Linear(8, 2))
    with pytest.raises(ShardError, match=r"cannot shard 0: EmbeddingBag\(sparse=True\) makes sparse gradients"):
        shard(sparse)
    with pytest.raises(ValueError, match="invalid mode='zero3'; accepted: full, hybrid"):
        shard(mlp(4, 4), "zero3")
    with pytest.raises(ValueError, match=r"invalid min_params=0; accepted: an integer >= 1 \(parameters per block\)"):
        shard(mlp(4, 4), min_params=0)
    with pytest.raises(ValueError, match=r"invalid compression='fp16' with mode='full'; accepted: none"):
        shard(mlp(4, 4), "full", compression="fp16")
    with pytest.raises(RuntimeError, match=r"shard\(\) needs the default process group"):
        shard(mlp(4, 4))


REFUSED_UNDER_SHARD = {
    "intra_compression": "fp16",
    "hierarchical": "on",
    "local_steps": 2,
    "autotune": "on",
    "bucket_mb": 25.0,
    "amp": "fp16",
    "amp_policy": "auto",
    "compile": "on",
    "nan_check": "warn",
    "metrics_every": 10,
    "straggler_every": 10,
    "timeline": "trace.json",
}


@pytest.mark.parametrize("mode", ["full", "hybrid"])
@pytest.mark.parametrize("option", sorted(REFUSED_UNDER_SHARD))
def test_options_of_ddps_exchange_are_refused_under_shard(mode, option):
    value = REFUSED_UNDER_SHARD[option]
    Config.resolve(env={}, **{option: value})  # accepted without shard
    with pytest.raises(ConfigError, match=rf"invalid {option}={value!r}; accepted: .* with shard={mode} \("):
        Config.resolve(env={}, shard=mode, **{option: value})


def test_sync_every_under_shard_is_for_hybrids_replicas():
    assert Config.resolve(env={}, shard="hybrid", sync_every=10).sync_every == 10
    with pytest.raises(ConfigError, match=r"invalid sync_every=10; accepted: 0 with shard=full \(no replicas to sync"):
        Config.resolve(env={}, shard="full", sync_every=10)
    with pytest.raises(ConfigError, match=r"invalid sync_warmup=5; accepted: 0 with shard=hybrid \(its steps would"):
        Config.resolve(env={}, shard="hybrid", sync_every=10, sync_warmup=5)
    assert Config.resolve(env={}, shard="hybrid", sync_every=10, sync_scope="node").sync_scope == "node"
    with pytest.raises(ConfigError, match=r"invalid sync_scope='rank'; accepted: auto, node with shard=hybrid \("):
        Config.resolve(env={}, shard="hybrid", sync_every=10, sync_scope="rank")
    with pytest.raises(ValueError, match=r"invalid sync_every=4 with mode='full', compression='none'; accepted: 0"):
        shard(mlp(4, 4), "full", sync_every=4)


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16", "topk", "randomk", "powersgd"])
def test_compression_under_shard_is_a_dense_codec_on_hybrids_cross_node_sum(compression):
    if compression in ("none", "fp16", "bf16"):
        assert Config.resolve(env={}, shard="hybrid", compression=compression).compression == compression
    else:
        with pytest.raises(ConfigError, match=r"accepted: none, fp16, bf16 with shard=hybrid \(the cross-node sum"):
            Config.resolve(env={}, shard="hybrid", compression=compression)
    if compression != "none":
        with pytest.raises(ConfigError, match=r"accepted: none with shard=full \(use shard=hybrid\)"):
            Config.resolve(env={}, shard="full", compression=compression)
    assert Config.resolve(env={"TRAINACCEL_SHARD": "hybrid"}).shard == "hybrid"


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    trainaccel.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_ddp_becomes_sharded_under_init_and_plain_again_after_shutdown(one_rank):
    trainaccel.init(shard="full", shard_min_params=10, start_process_group=False)
    model = mlp(4, 8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the wrap: rebound at its first step
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    assert isinstance(ddp, ShardedDataParallel) and ddp.module is model
    assert type(next(ddp.parameters())).__name__ == "DTensor"
    before = [p.full_tensor().clone() for p in ddp.parameters()]
    ddp(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    assert all(
        not torch.equal(a, p.full_tensor()) for a, p in zip(before, ddp.parameters())
    )  # the sharded ones stepped
    state = ddp.state_dict()
    assert sorted(state) == sorted(f"module.{k}" for k in mlp(4, 8, 2).state_dict())
    assert type(state["module.0.weight"]) is torch.Tensor
    with native_state_dicts():  # on request: FSDP2's own sharded form, as torch.distributed.checkpoint takes it
        sharded = get_model_state_dict(ddp.module)
    assert sorted(sharded) == sorted(mlp(4, 8, 2).state_dict()) and type(sharded["0.weight"]).__name__ == "DTensor"
    state["module.0.weight"] = torch.zeros(8, 4)
    assert not ddp.load_state_dict(state).missing_keys
    assert torch.equal(ddp.module[0].weight.full_tensor(), torch.zeros(8, 4))
    for call, message in [
        (lambda: ddp.register_comm_hook(None, None), "register_comm_hook: under shard=full FSDP2 reduces"),
        (lambda: ddp.join(), r"join\(\): uneven inputs are not supported under shard=full"),
        (
            lambda: torch.nn.parallel.DistributedDataParallel(mlp(4, 2), mixed_precision=object()),
            r"DistributedDataParallel\(mixed_precision=...\) under shard=full: not supported: DDP's own mixed",
        ),
    ]:
        with pytest.raises(ShardError, match=message):
            call()
    trainaccel.shutdown()
    assert type(torch.nn.parallel.DistributedDataParallel(mlp(4, 2))) is torch.nn.parallel.DistributedDataParallel


class _Tied(torch.nn.Module):
    """A head sharing the embedding's Parameter (GPT-2's tied weights)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


@pytest.mark.parametrize("mode", ["full", "hybrid"])
def test_tied_parameters_are_one_tensor_in_the_full_state_dict_and_round_trip_through_safetensors(
    one_rank, mode, tmp_path
):
    from safetensors.torch import load_model, save_model

    trainaccel.init(shard=mode, start_process_group=False)  # one unit: 'embed' alone would split the tie (refused)
    module = _Tied()
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    ddp(torch.arange(6)).sum().backward()
    optimizer.step()
    state = module.state_dict()
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr(), "the tied weights came back as two"
    save_model(module, str(tmp_path / "model.safetensors"))  # writes the shared tensor once
    load_model(module, str(tmp_path / "model.safetensors"))  # strict: the tied name left out is not missing
    fresh = _Tied()
    load_model(fresh, str(tmp_path / "model.safetensors"))
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, state["embed.weight"])


def test_a_torch_older_than_shardings_floor_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.8.0+cu126")
    for call in (lambda: trainaccel.init(shard="hybrid", start_process_group=False), lambda: shard(mlp(4, 2), "full")):
        with pytest.raises(ShardError, match=r"shard=(hybrid|full) needs torch 2.9 or later, and this is torch 2.8.0"):
            call()
        trainaccel.shutdown()


def test_buffers_cross_in_one_broadcast_per_dtype_each_step(one_rank, monkeypatch):
    """As DDP coalesces them: a BatchNorm's running mean and variance (float) and its count (int64), 2 calls."""
    trainaccel.init(shard="full", shard_min_params=10, start_process_group=False)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.BatchNorm1d(8))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    calls = []
    broadcast = dist.broadcast
    monkeypatch.setattr(
        dist, "broadcast", lambda tensor, *a, **k: calls.append(tensor.dtype) or broadcast(tensor, *a, **k)
    )
    before = [b.clone() for b in model.buffers()]
    ddp(torch.randn(5, 4)).sum().backward()
    assert sorted(map(str, calls)) == ["torch.float32", "torch.int64"]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.buffers()))  # the forward still updated them
    with torch.no_grad():
        ddp(torch.randn(5, 4))
    assert len(calls) == 2  # no broadcast outside a training forward


def test_one_optimizer_over_two_models_wrapped_at_different_times_steps_both_sharded(one_rank):
    trainaccel.init(shard="full", start_process_group=False)
    first, second = mlp(4, 2), mlp(2, 2)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.5)
    a = torch.nn.parallel.DistributedDataParallel(first)
    a(torch.ones(1, 4)).sum().backward()
    optimizer.step()  # rebinds first's parameters
    b = torch.nn.parallel.DistributedDataParallel(second)  # after the optimizer's first step
    before = [p.full_tensor().clone() for p in b.parameters()]
    b(a(torch.ones(1, 4))).sum().backward()
    optimizer.step()
    assert all(not torch.equal(x, p.full_tensor()) for x, p in zip(before, b.parameters()))
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in [*a.parameters(), *b.parameters()]]


def test_amp_bf16_under_shard_is_fsdp2s_mixed_precision(one_rank):
    trainaccel.init(shard="full", amp="bf16", shard_min_params=10, start_process_group=False)
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(4, 8, 2))
    output = ddp(torch.ones(3, 4))
    assert output.dtype == torch.bfloat16  # computed in bf16
    output.float().sum().backward()
    assert {p.dtype for p in ddp.parameters()} == {torch.float32}  # kept, and their gradients, in float32
    assert {p.grad.dtype for p in ddp.parameters()} == {torch.float32}


@pytest.mark.parametrize("min_params", [10, 10**6], ids=["units", "one_unit"])
@pytest.mark.parametrize("train", [True, False])
def test_amp_bf16_under_shard_keeps_batch_norms_in_float32(one_rank, train, min_params):
    """Cast to bf16 beside their float32 running statistics, batch norms failed in training and in evaluation; their
    float32 output then failed in a layer of the enclosing unit (one_unit: every layer in the root's)."""
    trainaccel.init(shard="full", amp="bf16", shard_min_params=min_params, start_process_group=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(288, 2)
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.train(train)
    means = model[1].running_mean.clone()
    with contextlib.nullcontext() if train else torch.no_grad():
        output = ddp(torch.randn(4, 3, 8, 8))
    assert output.dtype == torch.bfloat16 and output.isfinite().all()  # the convolution and the linear in bf16
    assert model[1].running_mean.dtype == torch.float32
    assert not torch.equal(means, model[1].running_mean) if train else torch.equal(means, model[1].running_mean)
    if train:
        output.float().sum().backward()
        assert {p.grad.dtype for p in ddp.parameters()} == {torch.float32}


class _WithUnused(torch.nn.Module):
    """Two used layers and one never used, each sharded on its own (shard_min_params=10)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.unused = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("find_unused", [False, True])
def test_no_sync_under_amp_bf16_gives_the_accumulated_gradients_with_an_unused_parameter(one_rank, find_unused):
    # FSDP2's own accumulation fails here under mixed precision (pytorch/pytorch#196996); the sum must not change.
    trainaccel.init(shard="full", amp="bf16", shard_min_params=10, start_process_group=False)
    if find_unused and not hasattr(torch.distributed.fsdp.FSDPModule, "set_reduce_scatter_unused_params"):
        with pytest.raises(ShardError, match=r"find_unused_parameters=True\) under shard=full needs torch 2.13"):
            torch.nn.parallel.DistributedDataParallel(_WithUnused(), find_unused_parameters=True)
        return  # refused in one line on a torch without it
    x1, x2 = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.ones(3, 4)
    grads = []
    for accumulate in (True, False):
        ddp = torch.nn.parallel.DistributedDataParallel(_WithUnused(), find_unused_parameters=find_unused)
        with ddp.no_sync() if accumulate else contextlib.nullcontext():
            ddp(x1).float().sum().backward()
        ddp(x2).float().sum().backward()
        grads.append([p.grad.full_tensor() for p in ddp.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) >= 4
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_an_optimizer_that_stepped_before_the_wrap_is_refused(one_rank):
    trainaccel.init(shard="full", start_process_group=False)
    model = mlp(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.ones(1, 4)).sum().backward()
    with pytest.raises(ShardError, match="Adam holds state for a parameter that sharding replaced"):
        optimizer.step()


def assert_same_training(sharded, reference, rel, mesh, params_abs=None):
    for got, want in zip(sharded, reference):
        assert got["mesh"] == mesh and want["mesh"] is None
        assert got["kind"] == "ShardedDataParallel" and want["kind"] == "DistributedDataParallel"
        assert got["losses"] == pytest.approx(want["losses"], rel=rel, abs=rel)
        assert got["losses"][0] != got["losses"][-1]  # it trained
        assert got["param_type"] == "Parameter"  # whole again after destroy_process_group()
        assert got["params"] == pytest.approx(want["params"], rel=rel, abs=params_abs or rel)


@pytest.mark.multiprocess
def test_parameters_unused_on_some_ranks_are_reduced_as_ddp_reduces_them(tmp_path):
    script = SCRIPTS / "ddp_checkpoint.py"  # a head only rank 0 uses; DDP(find_unused_parameters=True)
    (tmp_path / "ddp").mkdir(), (tmp_path / "full").mkdir()
    proc = run([*torchrun_cmd(), "--standalone", "--nproc-per-node", 2, script, tmp_path / "ddp", "--unused"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    command = [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 2, "--shard", "full"]
    proc = run([*command, script, tmp_path / "full", "--unused"], env={"TRAINACCEL_SHARD_MIN_PARAMS": "1000"})
    if not hasattr(torch.distributed.fsdp.FSDPModule, "set_reduce_scatter_unused_params"):  # before torch 2.13
        assert proc.returncode != 0 and "under shard=full needs torch 2.13" in proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_same_training(read_ranks(tmp_path / "full", 2), read_ranks(tmp_path / "ddp", 2), 1e-5, [2])


def _sharded_on_two_nodes(tmp_path, runs) -> list[dict]:
    """DDP's reference on 4 workers, then each of `runs` (name, env, args) on 2 emulated nodes x 2 under
    `trainaccel run`; returns the reference's rank results."""
    script = SCRIPTS / "ddp_checkpoint.py"
    for name in ("ddp", *(name for name, _, _ in runs)):
        (tmp_path / name).mkdir()
    proc = run([*torchrun_cmd(), "--standalone", "--nproc-per-node", 4, script, tmp_path / "ddp"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = {"TRAINACCEL_SHARD_MIN_PARAMS": "1000", "TRAINACCEL_SHARD": "hybrid"}
    for name, extra, args in runs:
        procs = run_nodes(script, tmp_path / name, *args, launcher=[*trainaccel_cmd(), "run"], env={**env, **extra})
        for proc in procs:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        if name == "fp16":  # sharded within the node ([2]), the shards summed across nodes by trainaccel
            assert "gradient shards summed across 2 replicas in fp16" in procs[0].stdout
    return read_ranks(tmp_path / "ddp", 4)


@pytest.mark.multiprocess
def test_hybrid_on_two_nodes_trains_as_ddp_and_its_checkpoint_loads_into_ddp_at_another_size(tmp_path):
    checkpoint = tmp_path / "hybrid.pt"
    reference = _sharded_on_two_nodes(tmp_path, [("hybrid", {}, ["--save", checkpoint])])
    assert_same_training(read_ranks(tmp_path / "hybrid", 4), reference, 1e-5, [2, 2])  # FSDP2's own HSDP
    (tmp_path / "loaded").mkdir()
    script = SCRIPTS / "ddp_checkpoint.py"
    proc = run(
        [*torchrun_cmd(), "--standalone", "--nproc-per-node", 2, script, tmp_path / "loaded", "--load", checkpoint]
        + ["--steps", 0]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = json.loads((tmp_path / "hybrid" / "rank0.json").read_text())["params"]
    assert [rank["params"] for rank in read_ranks(tmp_path / "loaded", 2)] == [saved, saved]


@pytest.mark.multiprocess
@pytest.mark.comm_full  # CI: hybrid above, and full on one node (test_parameters_unused_on_some_ranks_...)
def test_full_and_fp16_on_two_nodes_train_as_ddp(tmp_path):
    runs = [
        ("full", {"TRAINACCEL_SHARD": "full"}, ["--optimizer-first"]),  # its optimizer holds the unsharded ones
        ("fp16", {"TRAINACCEL_COMPRESSION": "fp16"}, []),
    ]
    reference = _sharded_on_two_nodes(tmp_path, runs)
    assert_same_training(read_ranks(tmp_path / "full", 4), reference, 1e-5, [4])
    # fp16 across nodes: close, not equal; AdamW moves a weight by up to lr (1e-2) a step whatever its gradient.
    assert_same_training(read_ranks(tmp_path / "fp16", 4), reference, 2e-3, [2], params_abs=1e-2)


@pytest.mark.multiprocess
def test_a_state_dict_called_on_rank_0_only_fails_at_once_naming_the_cause(tmp_path):
    began = time.monotonic()
    proc = run(
        [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", 2, "--shard", "full"]
        + [SCRIPTS / "ddp_checkpoint.py", tmp_path, "--save", tmp_path / "ck.pt", "--rank0-save"]
    )
    assert proc.returncode != 0
    message = "state_dict() of a sharded model gathers from every rank, and not every rank called it: rank(s) [1] "
    assert message + "trained on past step 3 without calling it" in proc.stdout + proc.stderr
    assert time.monotonic() - began < 60  # by the peer's heartbeat, not after the collective timeout (300 s)


@pytest.mark.multiprocess
@pytest.mark.comm_full  # CI: hybrid above, and zero-code sync_every's node-scope average (tests/comm/test_diloco.py)
def test_hybrid_with_sync_every_averages_the_replicas_across_nodes(tmp_path):
    script = SCRIPTS / "ddp_checkpoint.py"
    for name in ("ddp", "every1", "every3"):
        (tmp_path / name).mkdir()
    proc = run([*torchrun_cmd(), "--standalone", "--nproc-per-node", 4, script, tmp_path / "ddp", "--sgd"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = {"TRAINACCEL_SHARD_MIN_PARAMS": "1000", "TRAINACCEL_SHARD": "hybrid", "TRAINACCEL_OUTER_OPTIMIZER": "average"}
    for name, every, scope in [("every1", "1", "auto"), ("every3", "3", "node")]:
        procs = run_nodes(
            script,
            tmp_path / name,
            "--sgd",
            "--steps",
            6,  # the last step a sync: every replica is then the synced model
            launcher=[*trainaccel_cmd(), "run"],
            env={**env, "TRAINACCEL_SYNC_EVERY": every, "TRAINACCEL_SYNC_SCOPE": scope},
        )
        for proc in procs:
            assert proc.returncode == 0, proc.stdout + proc.stderr
            # hybrid's nodes are its replicas already: sync_scope=node is what it does, with no warning
            assert "replica of its own" not in proc.stdout + proc.stderr
    # Every step: each node steps on its own averaged gradient, then the nodes' parameters are averaged. With
    # plain SGD that is DDP's step exactly (the mean of the steps is the step of the mean gradient).
    reference = read_ranks(tmp_path / "ddp", 4)
    every1 = read_ranks(tmp_path / "every1", 4)
    for got, want in zip(every1, reference):
        assert got["losses"][:6] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    # Every 3 steps: the nodes' replicas differ between syncs (the losses), and every rank ends with the same,
    # trained model.
    every3 = read_ranks(tmp_path / "every3", 4)
    assert every3[0]["params"] == every3[1]["params"] == every3[2]["params"] == every3[3]["params"]
    assert every3[0]["losses"][3:] != pytest.approx(every1[0]["losses"][3:], rel=1e-4)
    assert every3[0]["params"] != pytest.approx(every1[0]["params"], abs=1e-6)  # synced less often: another model
    assert every3[0]["params"] == pytest.approx(every1[0]["params"], abs=0.05)  # ...near it (6 steps of lr 0.05)
