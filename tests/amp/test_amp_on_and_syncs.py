"""`amp=on` picks bfloat16 where the GPU computes it, and AMP's bookkeeping stops the host only where it must.

Without a GPU: the CUDA capability query is replaced, and a fused optimizer on the CPU shows which `.item()` calls
the loop makes (on a GPU each one waits for the device).
"""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import lr_scheduler
from torch.utils._python_dispatch import TorchDispatchMode

import trainaccel
import trainaccel.amp
from trainaccel.amp import ddp as amp_ddp


def _gpu(monkeypatch, native_bf16: bool) -> list[dict]:
    """A GPU that does (Ampere and later) or does not (V100, T4) compute bfloat16 natively; the queries' arguments."""
    asked = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append({"including_emulation": including_emulation})
        return native_bf16 or including_emulation  # older GPUs emulate it, slowly

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    return asked


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_on_picks_bfloat16_where_the_gpu_computes_it_natively_else_float16(monkeypatch, native, expected):
    asked = _gpu(monkeypatch, native)
    for device in ("cuda", torch.device("cuda"), torch.device("cuda", 0)):
        assert trainaccel.amp.autocast_dtype("on", device) == expected
    assert asked and all(a == {"including_emulation": False} for a in asked)  # emulated bfloat16 is slow
    asked.clear()
    assert trainaccel.amp.autocast_dtype("on", "cpu") == torch.bfloat16 and not asked
    assert trainaccel.amp.autocast_dtype("fp16", "cuda") == torch.float16  # asked for by name: kept
    assert trainaccel.amp.autocast_dtype("bf16", "cuda") == torch.bfloat16
    assert trainaccel.amp.autocast_dtype("off", "cuda") is None


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    return x, x[:, :2] * 3


def _float16_where_on_picks_it(monkeypatch) -> None:
    """`on` on a GPU without native bfloat16 picks float16; here on the CPU, whose autocast runs float16 too."""
    original = amp_ddp.autocast_dtype
    monkeypatch.setattr(
        amp_ddp, "autocast_dtype", lambda amp, device: torch.float16 if amp == "on" else original(amp, device)
    )


def test_on_in_float16_without_scaled_stops_at_the_first_forward_in_one_line_naming_the_way_out(
    one_worker, monkeypatch
):
    _float16_where_on_picks_it(monkeypatch)
    trainaccel.init(amp="on", start_process_group=False)
    model = DDP(_model())
    x, _ = _batch()
    with pytest.raises(RuntimeError) as raised:
        model(x)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("amp=on autocasts in float16 here")
    assert "trainaccel.amp.scaled(optimizer)" in message and "amp=off" in message


def test_on_in_float16_with_scaled_trains(one_worker, monkeypatch):
    _float16_where_on_picks_it(monkeypatch)
    trainaccel.init(amp="on", start_process_group=False)
    model = DDP(_model())
    optimizer = trainaccel.amp.scaled(torch.optim.SGD(model.parameters(), lr=0.05))
    assert optimizer.trainaccel_scaler is not None  # not a no-op: on picked float16
    x, y = _batch()
    for _ in range(3):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert model.trainaccel.amp.dtype == torch.float16 and model.trainaccel.amp.autocast_forwards == 3


class Syncs(TorchDispatchMode):
    """Counts the reads of a tensor's value on the host (`.item()`, `bool()`): on a GPU, each waits for it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_fused_optimizer_steps_under_scaled_without_a_host_sync_and_skips_are_still_counted(one_worker):
    trainaccel.init(amp="fp16", start_process_group=False)
    model = DDP(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)  # skips itself on inf/NaN, on the device
    trainaccel.amp.scaled(optimizer, torch.amp.GradScaler("cpu", init_scale=2.0**10))
    per_epoch = lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    x, y = _batch()
    syncs = Syncs()
    for epoch, skipped in enumerate([{0, 1, 2}, {0, 2}, {0, 1, 2}]):  # epochs 0 and 2: every step skipped
        for step in range(3):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            (loss * float("inf") if step in skipped else loss).backward()
            with syncs:
                optimizer.step()
        per_epoch.step()  # advances only after an epoch with a real step: it reads the skips here
        assert per_epoch.last_epoch == (0, 1, 1)[epoch]
    assert syncs.count == 0


class _WithItsOwnLoss(nn.Module):
    """A model that computes its loss when given labels, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x, labels=None):
        logits = self.net(x)
        out = {"logits": logits, "hidden": [logits * 2]}
        if labels is not None:
            out["loss"] = nn.functional.mse_loss(logits.float(), labels)
        return out


@pytest.mark.parametrize("labels", [True, False])
def test_outputs_come_back_float32_except_beside_the_models_own_loss(one_worker, labels):
    # A loss computed outside the model runs where autocast would run it in float32; beside a loss of its own the
    # other outputs (an LM's logits) stay in bfloat16, at half the memory.
    trainaccel.init(amp="bf16", start_process_group=False)
    model = DDP(_WithItsOwnLoss())
    x, y = _batch()
    out = model(x, labels=y if labels else None)
    expected = torch.bfloat16 if labels else torch.float32
    assert out["logits"].dtype == expected and out["hidden"][0].dtype == expected
    if labels:
        assert out["loss"].dtype == torch.float32
        out["loss"].backward()
        assert all(p.grad is not None for p in model.parameters())
