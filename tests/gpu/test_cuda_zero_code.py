"""Zero-code mode on a CUDA model in one worker (`trainaccel.init()` starts the group: NCCL for CUDA tensors):
AMP with its GradScaler, every codec's hook, sync_every's outer codecs."""

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import trainaccel
from gpu.helpers import Net, batches, train
from trainaccel.comm import comm_state
from trainaccel.observer import observer_of

pytestmark = pytest.mark.gpu


def ddp_of(device: torch.device) -> DistributedDataParallel:
    torch.manual_seed(0)
    return DistributedDataParallel(Net().to(device), device_ids=[device.index] if device.type == "cuda" else None)


@pytest.mark.parametrize("amp", ["fp16", "bf16", "on"])
def test_zero_code_amp_trains_on_the_gpu(one_worker_env, device, amp):
    trainaccel.init(amp=amp)
    # What `on` means on this device: bfloat16 where it is computed natively (CPUs, A100/H100 on), else float16.
    native = device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)
    half = torch.bfloat16 if native else torch.float16
    expected = {"fp16": torch.float16, "bf16": torch.bfloat16, "on": half}[amp]
    model = ddp_of(device)
    seen = []
    model.module[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    optimizer = trainaccel.amp.scaled(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    losses = train(model, optimizer, batches(device, 40))
    assert set(seen) == {expected}, "the forward did not run in the autocast dtype"
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
    scaler = getattr(optimizer, "trainaccel_scaler", None)
    if expected == torch.float16:
        assert scaler is not None, "fp16 without a GradScaler"
        assert scaler._device == device.type  # a CUDA GradScaler for a CUDA model
        assert 0 < scaler.get_scale() <= 2.0**16  # it scaled (and unscaled: else lr x 65536 would diverge)
    else:
        assert scaler is None
    assert next(model.parameters()).dtype == torch.float32  # the weights stay float32
    with torch.no_grad():
        assert model(batches(device, 1)[0][0]).dtype == torch.float32  # handed back in float32


ENGINE = {
    "none (trainaccel's hook)": {"compression": "none", "nan_check": "warn"},
    "fp16": {"compression": "fp16"},
    "bf16": {"compression": "bf16"},
    "topk": {"compression": "topk", "compression_ratio": 0.1, "compression_warmup": 1},
    "randomk": {"compression": "randomk", "compression_ratio": 0.1, "compression_warmup": 1},
    "powersgd": {"compression": "powersgd", "compression_warmup": 1},
    "fp16, nan_check raise, metrics, stragglers": {
        "compression": "fp16",
        "nan_check": "raise",
        "metrics_every": 3,
        "straggler_every": 3,
    },
    "sync_every 2, outer int8": {"sync_every": 2, "outer_compression": "int8"},
    "sync_every 2, outer fp4": {"sync_every": 2, "outer_compression": "fp4"},
    "sync_every 4, fragments 2, overlap 1, nesterov": {
        "sync_every": 4,
        "sync_fragments": 2,
        "sync_overlap": 1,
        "outer_optimizer": "nesterov",
    },
}


@pytest.mark.parametrize("options", ENGINE.values(), ids=ENGINE.keys())
def test_the_engine_trains_a_gpu_model(one_worker_env, device, options, monkeypatch):
    trainaccel.init(**options)
    model = ddp_of(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    largest, broadcast = [0], torch.distributed.broadcast

    def counted(tensor, *args, **kwargs):
        largest[0] = max(largest[0], tensor.numel())
        return broadcast(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.distributed, "broadcast", counted)
    losses = train(model, optimizer, batches(device, 12))
    assert all(math.isfinite(v) for v in losses) and sum(losses[-3:]) < sum(losses[:3]), losses
    model.eval()  # a look: sync_every's replicas synced
    assert all(p.device == device and bool(p.isfinite().all()) for p in model.parameters())
    diloco = observer_of(model).diloco
    if "sync_every" in options:
        assert diloco is not None and diloco.syncs >= 12 // options["sync_every"] - 1
        # The first step took the model DDP broadcast as it wrapped it (the ranks agreed over the device's group).
        assert largest[0] < sum(p.numel() for p in model.parameters()), largest
        if options.get("outer_compression"):
            feedback = diloco.outer.feedback
            assert feedback is not None and feedback.residuals
            assert all(r.device == device for r in feedback.residuals.values())
    else:
        state = comm_state(model)
        assert not state.builtin and state.reductions == 12  # trainaccel's hook reduced every step
        if state.feedback is not None:
            assert all(r.device == device for r in state.feedback.residuals.values())


@pytest.mark.parametrize("scale", ["auto", "dynamic"])
def test_fp16_on_a_gpu_reads_no_sum_on_the_host_by_default(one_worker_env, device, needs_cuda, scale):
    # fp16_scale=auto is the peak's scale on a GPU: no host read waits for the device (a sync raises here, on the
    # communication thread, and fails the backward); the dynamic scale reads each bucket's sum for its exact retry.
    trainaccel.init(compression="fp16", fp16_scale=scale)
    model = ddp_of(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train(model, optimizer, batches(device, 3))  # DDP's first steps: its buckets, the exact first step
    state = comm_state(model)
    assert state.codec.by_peak == (scale == "auto") and state.codec.dynamic == (scale == "dynamic")
    data = batches(device, 4, seed=1)  # copied to the device before: a copy from pageable memory is a sync
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in data:
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        failed = None
    except RuntimeError as e:
        failed = str(e)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize(device)
    if scale == "auto":
        assert failed is None, failed
        assert state.fallbacks == 0 and all(bool(p.isfinite().all()) for p in model.parameters())
    else:
        assert failed is not None and "synchroniz" in failed, "the dynamic scale's read was not seen"
