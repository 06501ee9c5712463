"""Zero-code fp16 in one process: `trainaccel.amp.scaled` equals the hand-written autocast + GradScaler loop."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import clip_grad, clip_grad_norm_  # bound by name before any patch, as scripts do
from torch.optim import lr_scheduler

import trainaccel
import trainaccel.amp
from amp.helpers import patchable


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


def _fit(model, optimizer, clip, scaler=None, steps: int = 16) -> list[float]:
    """Fit one batch, clipping each step; autocast and `scaler` by hand when given (unscale_ before `clip`)."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    y = x[:, :2] * 10  # large gradients: the clip binds
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        optimizer.zero_grad()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        clip(model, optimizer)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        losses.append(loss.item())
    return losses


INIT_SCALE = 2.0**16  # overflows at first: skipped steps are compared too
CLIPS = {
    "torch.nn.utils.clip_grad_norm_": lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0),
    "clip_grad.clip_grad_norm_": lambda m, o: clip_grad.clip_grad_norm_(parameters=list(m.parameters()), max_norm=1.0),
    "imported before the patch": lambda m, o: clip_grad_norm_(m.parameters(), 1.0),
    "clip_grad_value_": lambda m, o: torch.nn.utils.clip_grad_value_(m.parameters(), 0.2),
    "get_total_norm, clip_grads_with_norm_": lambda m, o: torch.nn.utils.clip_grads_with_norm_(
        m.parameters(), 1.0, torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
    ),
    "the script's own unscale_ first": lambda m, o: (
        o.trainaccel_scaler.unscale_(o),
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0),
    ),
}


@pytest.mark.parametrize("clip", CLIPS)
def test_clipping_sees_unscaled_gradients_like_the_gradscaler_recipe(one_worker, clip):
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    same = CLIPS["clip_grad_value_" if clip == "clip_grad_value_" else "torch.nn.utils.clip_grad_norm_"]
    ref_losses = _fit(reference, ref_opt, same, ref_scaler)

    trainaccel.init(amp="fp16", start_process_group=False)
    model = DDP(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    trainaccel.amp.scaled(optimizer, torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))
    losses = _fit(model, optimizer, CLIPS[clip])
    assert losses == ref_losses
    for mine, theirs in zip(model.module.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert optimizer.trainaccel_scaler.get_scale() < INIT_SCALE  # it did skip
    assert losses[-1] < 0.5 * losses[0]  # clipping scaled gradients would barely move it


def test_clipping_parameters_of_no_scaled_optimizer_stops_with_the_reason(one_worker):
    trainaccel.init(amp="fp16", start_process_group=False)
    model = DDP(_model())
    trainaccel.amp.scaled(torch.optim.SGD(model.module[0].parameters(), lr=0.1))
    x, y = next(_batches(1))
    nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.module[0].parameters(), 1.0)  # its own: fine
    with pytest.raises(RuntimeError, match="2 of these parameters belong to no optimizer passed to trainaccel.amp"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.nn.utils.get_total_norm([p.detach() for p in model.parameters()])  # any tensors' norm: no gradients


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])  # fused: it skips inside its own step
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")  # `other` never steps
def test_schedulers_skip_with_the_optimizer_steps_the_scaler_skipped(
    one_worker, trainaccel_messages, monkeypatch, fused
):
    trainaccel.init(amp="fp16", start_process_group=False)
    model = DDP(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    before = lr_scheduler.StepLR(optimizer, 1, gamma=0.5)  # built before scaled(): its first step counts too
    trainaccel.amp.scaled(optimizer, torch.amp.GradScaler("cpu", init_scale=2.0**10))
    per_step = lr_scheduler.ExponentialLR(optimizer, gamma=0.9)  # after scaled(): torch wraps its step
    plateau = lr_scheduler.ReduceLROnPlateau(optimizer, patience=100)  # overrides step
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    untouched = lr_scheduler.StepLR(other, 1, gamma=0.5)  # its optimizer is not under scaled()
    real = 0  # steps that changed the weights
    skipped_at = {0, 3, 4}
    for step, (x, y) in enumerate(_batches(8)):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        (loss * float("inf") if step in skipped_at else loss).backward()
        weights = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        real += any(not torch.equal(w, p) for w, p in zip(weights, model.parameters()))
        for scheduler in (before, per_step):
            scheduler.step()
        plateau.step(loss.item())
        untouched.step()
        if step == 4:
            late = lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=1)  # right after a skipped step
            assert late.last_epoch == 0  # its initial step ran all the same
    assert real == 8 - len(skipped_at) == before.last_epoch == per_step.last_epoch == plateau.last_epoch
    assert per_step.get_last_lr() == pytest.approx([0.1 * 0.5**5 * 0.9**5])  # each one compounds
    assert untouched.last_epoch == 8
    assert any("scheduler step was skipped along with its optimizer's" in m for m in trainaccel_messages)


def test_a_scheduler_stepped_per_epoch_advances_when_any_step_of_the_epoch_was_real(one_worker):
    trainaccel.init(amp="fp16", start_process_group=False)
    model = DDP(_model())
    optimizer = trainaccel.amp.scaled(torch.optim.SGD(model.parameters(), lr=0.1))
    per_epoch = lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    for _epoch in range(3):
        for step, (x, y) in enumerate(_batches(3)):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            (loss * float("inf") if step == 2 else loss).backward()  # the epoch's last step is skipped
            optimizer.step()
        per_epoch.step()
    assert per_epoch.last_epoch == 3


def test_reset_restores_every_function_it_patched(one_worker):
    originals = patchable()
    trainaccel.init(amp="fp16", start_process_group=False)
    trainaccel.amp.scaled(torch.optim.SGD(_model().parameters(), lr=0.1))
    patched = patchable()
    assert {name for name in originals if patched[name] is not originals[name]} == {
        "Tensor.backward",
        *(
            f"torch.nn.utils.{name}"
            for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm")
        ),
        *(
            f"torch.nn.utils.clip_grad.{name}"
            for name in ("clip_grad_norm_", "clip_grad_value_", "_clip_grads_with_norm_", "_get_total_norm")
        ),
        *(
            f"{cls}.step"
            for cls in (
                "LRScheduler",
                "ReduceLROnPlateau",
                "SequentialLR",
                "ChainedScheduler",
                "CosineAnnealingWarmRestarts",
            )
        ),
    }
    assert torch.nn.utils.clip_grad_norm_ is clip_grad.clip_grad_norm_  # one wrapper, wherever it is reached
    trainaccel.shutdown()
    assert patchable() == originals
    assert torch.nn.utils.clip_grad_norm_ is clip_grad_norm_
    assert vars(lr_scheduler.LRScheduler)["step"].__qualname__ == "LRScheduler.step"
