"""Zero-code fp16 in one process: `trainaccel.amp.scaled` equals the hand-written autocast + GradScaler loop."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel
import trainaccel.amp
from trainaccel import runtime
from trainaccel.amp import ddp as amp_ddp
from trainaccel.comm import unpatch_ddp


@pytest.fixture
def one_worker(tmp_path, monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("TRAINACCEL_"):
            monkeypatch.delenv(name)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    backward = torch.Tensor.backward
    yield
    dist.destroy_process_group()
    unpatch_ddp()
    amp_ddp.reset()
    runtime._config = None
    assert torch.Tensor.backward is backward  # reset() undid the global hooks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _batches(steps: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        yield x, x[:, :2] * 3


def test_scaled_fp16_equals_autocast_with_a_gradscaler(one_worker):
    steps = 12
    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # overflows at first: skipped steps are compared too
    ref_losses = []
    for x, y in _batches(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            out = reference(x)
        loss = nn.functional.mse_loss(out.float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        ref_losses.append(loss.item())

    trainaccel.init(amp="fp16", start_process_group=False)
    model = DDP(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    assert trainaccel.amp.scaled(optimizer, torch.amp.GradScaler("cpu", init_scale=2.0**24)) is optimizer
    losses = []
    for x, y in _batches(steps):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses == ref_losses
    assert optimizer.trainaccel_scaler.get_scale() == scaler.get_scale() < 2.0**24  # it did skip and shrink
    for mine, theirs in zip(model.module.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_an_optimizer_left_unscaled_is_stopped_before_it_steps(one_worker):
    trainaccel.init(amp="fp16", start_process_group=False)
    model = DDP(_model())
    first = trainaccel.amp.scaled(torch.optim.SGD(model.module[0].parameters(), lr=0.1))
    second = torch.optim.SGD(model.module[2].parameters(), lr=0.1)
    before = copy.deepcopy(model.module[2].state_dict())
    x, y = next(_batches(1))
    nn.functional.mse_loss(model(x), y).backward()
    first.step()
    with pytest.raises(RuntimeError, match="this SGD would step on them unscaled: pass every optimizer"):
        second.step()
    assert all(torch.equal(v, model.module[2].state_dict()[k]) for k, v in before.items())


def test_scaled_is_a_no_op_unless_autocasting_in_float16(one_worker):
    optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    step = optimizer.step
    assert trainaccel.amp.scaled(optimizer) is optimizer and optimizer.step == step  # no init()
    trainaccel.init(amp="bf16", start_process_group=False)
    assert trainaccel.amp.scaled(optimizer) is optimizer and optimizer.step == step
    assert getattr(optimizer, "trainaccel_scaler", None) is None
    trainaccel.init(amp="on", start_process_group=False)  # on CPU: bfloat16
    assert trainaccel.amp.scaled(optimizer) is optimizer and optimizer.step == step


def test_fp16_without_scaled_stops_at_the_first_training_forward_naming_the_line(one_worker):
    trainaccel.init(amp="fp16", start_process_group=False)
    model = DDP(_model())
    x, _ = next(_batches(1))
    with torch.no_grad():
        assert model(x).dtype == torch.float32  # evaluation needs no loss scaling
    with pytest.raises(RuntimeError, match=r"add `optimizer = trainaccel.amp.scaled\(optimizer\)`"):
        model(x)
