"""Patterns of well-known training scripts and frameworks under the zero-code options, in one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainaccel


@pytest.fixture
def group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    trainaccel.shutdown()
    dist.destroy_process_group()


class Wrapper(nn.Module):
    """What Lightning puts inside DDP: a module of no parameters of its own around the LightningModule."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self._forward_module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_module(x)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        optimizer.zero_grad()
        model(torch.randn(3, 4, generator=g)).square().mean().backward()
        optimizer.step()


@pytest.mark.usefixtures("group")
@pytest.mark.parametrize("mode", ["framework", "all_eval", "train"])
def test_a_training_forward_is_one_with_gradients_on_whatever_the_modes(mode):
    """Lightning switches only its LightningModule between train and eval and leaves the DDP model in eval mode after
    its sanity check; some scripts train in eval mode throughout. DDP exchanges gradients in all of these."""
    trainaccel.init(compression="fp16", start_process_group=False)
    inner = _net()
    model = DDP(Wrapper(inner))
    if mode != "train":
        model.eval()
    if mode == "framework":
        inner.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, optimizer, 2)
    sent = trainaccel.comm.bytes_sent(model)
    _train(model, optimizer, 2)
    assert model.trainaccel.step == 4
    assert model._get_ddp_logging_data().get("comm_hook") == "trainaccel_comm_hook"
    full = sum(p.numel() * 4 for p in model.parameters())
    assert trainaccel.comm.bytes_per_step(model, sent, 2) == pytest.approx(full / 2, rel=0.01)  # fp16: half
    assert model.trainaccel.training_mode() == (mode != "all_eval")
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert model.trainaccel.step == 4  # an evaluation is not a step


@pytest.mark.usefixtures("group")
def test_the_mode_of_a_framework_inner_module_decides_what_a_look_sees():
    """Under sync_every an evaluation (gradients off, eval mode) runs on the synced model: Lightning's eval() reaches
    its LightningModule only, inside the module DDP wraps."""
    trainaccel.init(sync_every=3, start_process_group=False)
    inner = _net()
    model = DDP(Wrapper(inner))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, optimizer, 4)  # a sync at 3, and one step past it
    synced = {name: value.clone() for name, value in inner.state_dict().items()}
    live = {name: p.detach().clone() for name, p in inner.named_parameters()}
    assert not all(torch.equal(synced[n], live[n]) for n in live)
    x = torch.randn(2, 4)
    reference = _net()
    reference.load_state_dict(synced)
    model.train()
    inner.eval()  # as Lightning's validation loop does, with the DDP model left as it was
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    inner.train()
    assert all(torch.equal(p, live[n]) for n, p in inner.named_parameters())


@pytest.mark.usefixtures("group")
def test_a_script_turning_ddps_exchange_back_on_is_kept_off_under_sync_every(trainaccel_messages):
    """nanoGPT's accumulation sets `require_backward_grad_sync = (micro == last)`: plain DDP's allreduce, unseen."""
    trainaccel.init(sync_every=4, sync_scope="rank", start_process_group=False)
    model = DDP(_net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(3):
        for micro in range(2):
            model.require_backward_grad_sync = micro == 1
            model(torch.randn(3, 4)).square().mean().backward()
            assert model.require_backward_grad_sync is False
        optimizer.step()
        optimizer.zero_grad()
    assert any("turned DDP's gradient exchange on" in m for m in trainaccel_messages)
    assert model.trainaccel.diloco.steps == 3


@pytest.mark.usefixtures("group")
@pytest.mark.parametrize(
    "options, lost",
    [
        ({"sync_every": 2, "outer_optimizer": "nesterov"}, "sync_every's outer momentum"),
        ({"sync_every": 2, "outer_optimizer": "average", "outer_compression": "int8"}, "int8's residuals"),
        ({"compression": "topk"}, "topk's residuals"),
        ({"compression": "none"}, None),
    ],
)
def test_a_state_dict_without_the_engine_state_says_what_a_resume_loses(options, lost, trainaccel_messages):
    trainaccel.init(start_process_group=False, **options)
    model = DDP(_net())
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 2)
    with_engine = model.state_dict()
    tensors_only = {name: value.clone() for name, value in with_engine.items()}  # as safetensors or DCP keep it
    model.load_state_dict(with_engine)
    assert not any("carries no trainaccel engine state" in m for m in trainaccel_messages)
    model.load_state_dict(tensors_only)
    said = [m for m in trainaccel_messages if "carries no trainaccel engine state" in m]
    if lost is None:
        assert said == []
    else:
        assert len(said) == 1 and lost in said[0] and "trainaccel.comm.state_dict(model)" in said[0]
    layer = {k.removeprefix("module.0."): v for k, v in tensors_only.items() if k.startswith("module.0.")}
    model.module[0].load_state_dict(layer)  # one layer's own weights: not a resume
    assert len([m for m in trainaccel_messages if "carries no trainaccel engine state" in m]) == len(said)


@pytest.mark.usefixtures("group")
def test_a_module_wrapped_in_ddp_again_keeps_one_diloco():
    """Unfreezing layers usually means a new DDP model around the same module: one replica, one schedule."""
    trainaccel.init(sync_every=3, sync_scope="rank", start_process_group=False)
    module = _net()
    first = DDP(module)
    _train(first, torch.optim.SGD(first.parameters(), lr=0.1), 2)
    second = DDP(module)
    assert second.trainaccel.diloco is first.trainaccel.diloco
    assert second.require_backward_grad_sync is False and second.broadcast_buffers is False
    _train(second, torch.optim.SGD(second.parameters(), lr=0.1), 2)
    assert second.trainaccel.diloco.steps == 4 and second.trainaccel.diloco.syncs == 1


@pytest.mark.usefixtures("group")
def test_an_iteration_the_script_skips_still_counts_as_an_inner_step():
    """`if not torch.isfinite(norm): optimizer.zero_grad(); continue` skips a step on the rank whose own gradients
    are not finite; under sync_every gradients are each rank's own, so the other ranks step. Every rank must still
    count the iteration (as a GradScaler's skip counts), or its syncs fall one step behind the others' and the last
    sync waits for a rank that has stopped training."""
    trainaccel.init(sync_every=2, sync_scope="rank", start_process_group=False)
    model = DDP(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(4):
        optimizer.zero_grad()
        loss = model(torch.randn(3, 4)).square().mean()
        if i == 1:
            loss = loss * float("inf")
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not torch.isfinite(norm):
            optimizer.zero_grad()
            continue
        optimizer.step()
    model(torch.randn(3, 4))  # the next training forward ends any iteration still open
    assert model.trainaccel.diloco.steps == 4
    assert model.trainaccel.diloco.syncs == 2


@pytest.mark.usefixtures("group")
def test_layers_unfrozen_by_wrapping_again_are_synced_too():
    """Fine-tuning recipes train with the backbone frozen, then set requires_grad and wrap the module in a new DDP
    model. The layers unfrozen then train like the others, so they must be synced like the others: a look after a
    sync and one more step sees them as the sync left them, not the live replica's own steps."""
    trainaccel.init(sync_every=2, sync_scope="rank", start_process_group=False)
    module = _net()
    module[0].requires_grad_(False)
    first = DDP(module)
    _train(first, torch.optim.SGD([p for p in first.parameters() if p.requires_grad], lr=0.1), 2)
    module[0].requires_grad_(True)
    second = DDP(module)
    optimizer = torch.optim.SGD(second.parameters(), lr=0.1)
    _train(second, optimizer, 2)  # the sync at step 4 takes every trainable parameter
    at_sync = {name: p.detach().clone() for name, p in module.named_parameters()}
    _train(second, optimizer, 1)
    looked = module.state_dict()
    for name, p in module.named_parameters():
        assert not torch.equal(p, at_sync[name])
        assert torch.equal(looked[name], at_sync[name]), name


@pytest.mark.usefixtures("group")
def test_loading_an_ema_copy_says_nothing_about_the_engine_state(trainaccel_messages):
    """Reference recipes resume the model from the checkpoint's `model` entry, then its EMA copy (a deepcopy of the
    module, or an AveragedModel around one) from `model_ema`. The copy never carried engine state: loading it is no
    resume, and a warning that the residuals start anew would say the resume just done lost them."""
    trainaccel.init(compression="fp16", start_process_group=False)
    model = DDP(_net())
    ema = copy.deepcopy(model.module)
    averaged = torch.optim.swa_utils.AveragedModel(model.module)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    model.module.load_state_dict(model.module.state_dict())
    ema.load_state_dict(ema.state_dict())
    averaged.load_state_dict(averaged.state_dict())
    assert not any("carries no trainaccel engine state" in m for m in trainaccel_messages)


@pytest.mark.usefixtures("group")
@pytest.mark.parametrize("saved_by", [0, 1])
def test_residuals_are_restored_on_the_rank_that_saved_them_only(saved_by, trainaccel_messages):
    """A checkpoint saved by rank 0 alone carries rank 0's residuals: another rank starts its own empty."""
    trainaccel.init(sync_every=2, outer_compression="int8", start_process_group=False)
    model = DDP(_net())
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 3)
    state = model.state_dict()
    engine = next(m["trainaccel_comm"] for m in state._metadata.values() if "trainaccel_comm" in m)
    assert engine["diloco"]["residuals"]  # int8 leaves something unsent
    engine["rank"] = saved_by  # as if another rank had saved it
    resumed = DDP(_net())
    resumed.load_state_dict(state)
    residuals = resumed.trainaccel.diloco.outer.feedback.residuals
    if saved_by == 0:
        assert residuals.keys() == engine["diloco"]["residuals"].keys()
        assert all(torch.equal(residuals[k], v) for k, v in engine["diloco"]["residuals"].items())
    else:
        assert residuals == {}
        assert any("is not this rank's (it was saved by rank 1)" in m for m in trainaccel_messages)
