"""`trainaccel.compile`: in place, presets checked, eager with a clear message when it cannot compile."""

import pytest
import torch
from torch import nn

import trainaccel
from trainaccel import compiler


@pytest.fixture
def messages(trainaccel_messages):
    return trainaccel_messages


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))


def _train(model: nn.Module, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :2])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.multiprocess  # inductor runs the C++ compiler
def test_compiles_in_place_and_trains_like_eager():
    torch._dynamo.reset()
    eager = _train(_model())
    model = _model()
    keys = list(model.state_dict())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert trainaccel.compile(model) is model and compiler.is_compiled(model)
    assert _train(model) == pytest.approx(eager, rel=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # it really compiled
    assert list(model.state_dict()) == keys  # no _orig_mod. prefix: checkpoints load either way


def _failing_backend(graph_module, example_inputs):
    raise RuntimeError("no code generator here")


def test_a_compiler_failure_falls_back_to_eager_once_with_a_warning(messages):
    torch._dynamo.reset()
    eager = _train(_model())
    model = trainaccel.compile(_model(), backend=_failing_backend)
    assert _train(model) == eager
    assert not compiler.is_compiled(model)
    warnings = [m for m in messages if m.startswith("torch.compile failed")]
    assert len(warnings) == 1 and "no code generator here" in warnings[0] and "Sequential runs eager" in warnings[0]


def test_a_missing_toolchain_leaves_the_model_eager_or_raises(monkeypatch, messages):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(compiler.shutil, "which", lambda name: None)
    model = _model()
    assert trainaccel.compile(model) is model and not compiler.is_compiled(model)
    assert messages == [
        "not compiling Sequential (inductor needs a C++ compiler for CPU code: none of $CXX, g++, c++, "
        "clang++ is on PATH): it runs eager"
    ]
    with pytest.raises(RuntimeError, match="cannot compile: inductor needs a C\\+\\+ compiler"):
        trainaccel.compile(model, fallback=False)
    assert compiler.missing_toolchain("eager", "cpu") == ""  # other backends need no compiler
    monkeypatch.setattr(compiler.importlib.util, "find_spec", lambda name: None)
    assert compiler.missing_toolchain("inductor", "cuda") == "inductor needs Triton for CUDA code (pip install triton)"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="invalid preset='fastest'; accepted: default, reduce-overhead, max-autotune"):
        trainaccel.compile(_model(), preset="fastest")
    with pytest.raises(TypeError, match="takes an nn.Module, got function"):
        trainaccel.compile(_train)


def test_ddp_buckets_below_dynamos_first_bucket_stay_eager(tmp_path, messages):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        small = trainaccel.compile(DDP(_model(), bucket_cap_mb=0.5))
        assert not compiler.is_compiled(small) and "smaller than the first bucket (1 MiB)" in messages[-1]
        assert compiler.is_compiled(trainaccel.compile(DDP(_model())))
    finally:
        dist.destroy_process_group()
