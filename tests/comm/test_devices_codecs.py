"""Codecs follow their input's device and never stop the host, shown without a GPU.

A tensor on the `meta` device has a shape and a dtype and no data: an op whose other tensors live
elsewhere fails on it with a device mismatch, and anything that reads a value on the host (`bool()`,
`.item()`, `.tolist()`) raises. So a codec that runs through on meta tensors builds what it needs on
its input's device and issues no host sync: what it must do on a GPU. A dispatch mode records every
op's tensors on top, to catch what meta lets through (a table copied from the CPU on every call).
"""

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainaccel.comm.codecs import CODECS, BlockQuantized, ErrorFeedback, RandomK, get_codec

META = torch.device("meta")


class Elsewhere(TorchDispatchMode):
    """Records the ops that touch a tensor off `device` (0-dim CPU operands, which kernels read as scalars, apart)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.found = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in inputs + outputs:
            if t.device != self.device and not (t.device.type == "cpu" and t.dim() == 0 and t in inputs):
                self.found.append(f"{func}: a tensor on {t.device}")
        return out


def _round_trip(codec, tensor: torch.Tensor, key=0) -> None:
    """Every step the engine takes with a codec: compress, the finiteness view, decode, accumulate, zero_sent."""
    payload, ctx = codec.compress(tensor, key)
    values = getattr(codec, "values", None)
    if values is not None:
        values(payload).isfinite()
    out = codec.decompress(payload, ctx)
    assert out.device == tensor.device and out.shape == tensor.shape and out.dtype == tensor.dtype
    accumulate = getattr(codec, "accumulate", None)
    if accumulate is not None:
        accumulate(payload, ctx, torch.zeros_like(tensor))
    zero_sent = getattr(codec, "zero_sent", None)
    if zero_sent is not None:
        zero_sent(tensor.clone(), payload, ctx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", CODECS)
def test_every_codec_runs_on_its_inputs_device_without_a_host_sync(name, dtype):
    codec = get_codec(name, ratio=0.1, fp16_scale="dynamic" if name == "fp16" else 1.0)
    tensor = torch.empty(1000, dtype=dtype, device=META)
    _round_trip(codec, tensor)  # the first call may build tables on the device, once
    with Elsewhere(META) as seen:
        for _ in range(3):  # randomk: past the end of a round, into the next
            _round_trip(codec, tensor)
    assert not seen.found, f"{name} on a meta tensor touched other devices: {seen.found[:5]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp16s_scale_from_the_peak_stays_on_the_inputs_device(dtype):
    codec = get_codec("fp16", fp16_scale="peak")
    tensor = torch.empty(1000, dtype=dtype, device=META)
    with Elsewhere(META) as seen:
        scale = codec.peak_scale(torch.empty(1, device=META), 4)
        payload, ctx = codec.compress(tensor, 0, scale=scale)
        assert codec.decompress(payload, ctx).dtype == dtype
        codec.decompress_into(payload, ctx, torch.empty_like(tensor))
    assert not seen.found, seen.found[:5]


@pytest.mark.parametrize("name", ["topk", "randomk", "int8", "fp4"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_error_feedback_keeps_its_state_on_the_gradients_device(name, momentum):
    feedback, codec = ErrorFeedback(momentum, masking=True), get_codec(name, ratio=0.1)
    gradient = torch.empty(700, device=META)

    def step() -> None:
        corrected = feedback.correct("b", gradient, scale=0.5, velocity=torch.empty(700, device=META))
        payload, ctx = codec.compress(corrected, "b")
        feedback.update("b", corrected, codec, payload, ctx)

    step()  # the first step builds the residual, the velocity (and fp4's tables) on the device
    with Elsewhere(META) as seen:
        step()
        feedback.clear("b")
    assert feedback.residuals["b"].device == META and not seen.found, seen.found[:5]


def test_fp4_builds_its_tables_once_per_device():
    codec = BlockQuantized("fp4")
    codec.compress(torch.empty(512, device=META))
    with Elsewhere(META) as seen:
        codec.decompress(*codec.compress(torch.empty(512, device=META)))
        BlockQuantized("fp4").decompress(*BlockQuantized("fp4").compress(torch.empty(300, device=META)))
    assert not seen.found  # no copy from the host after the first call, for any instance


def _reference_block_payload(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """BlockQuantized.compress as it was, with the host check before normalising (the bits to keep)."""
    top, n = (127.0 if name == "int8" else 6.0), tensor.numel()
    blocks = -(-n // 256)
    x = torch.nn.functional.pad(tensor.float(), (0, blocks * 256 - n)).view(blocks, 256)
    scales = x.abs().amax(dim=1) / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    if not bool(scales.isfinite().all()):
        x = x.nan_to_num(0.0, 0.0, 0.0)
    if name == "int8":
        codes = (x / safe[:, None]).round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8).reshape(-1)
    else:
        nearest = torch.tensor([sum(q >= e for e in (1, 3, 5, 7, 10, 14, 20)) for q in range(25)], dtype=torch.uint8)
        x = (x / safe[:, None]).mul_(4.0)
        code = nearest[x.abs().clamp_(max=24.0).to(torch.int64)] | ((x < 0).to(torch.uint8) << 3)
        codes = (code[:, 0::2] | (code[:, 1::2] << 4)).reshape(-1)
    return torch.cat([scales.view(torch.uint8), codes])


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(1000, generator=g) * torch.logspace(-30, 30, 1000)
    tiny = torch.tensor([1e-40, -3e-41, 0.0, 2e-45] * 70)
    mixed = torch.randn(777, generator=g)
    mixed[5], mixed[300], mixed[301], mixed[700] = float("nan"), float("inf"), -3.0, float("-inf")
    # Every quarter from -6 to 6 in blocks whose largest magnitude is 6 (fp4's midpoints, ties included), -0.0 and
    # small negatives that round to a signed zero.
    quarters = torch.cat([torch.tensor([6.0]), torch.arange(-24, 25) / 4, torch.tensor([-0.0, -1e-3, -0.2])]).repeat(6)
    return [
        torch.randn(1, generator=g),
        torch.randn(2049, generator=g).half(),
        wide,
        tiny,
        torch.zeros(300),
        mixed,
        quarters,
        quarters + 1e-6,
        -quarters,
    ]


def test_fp4_nearest_code_is_its_table():
    quarters = torch.arange(25, dtype=torch.uint8)
    assert torch.equal(BlockQuantized._nearest(quarters), BlockQuantized._NEAREST)


@pytest.mark.parametrize("name", ["int8", "fp4"])
def test_block_codecs_keep_their_bits_without_the_host_check(name):
    codec = BlockQuantized(name)
    for tensor in _inputs():
        payload, _ = codec.compress(tensor)
        assert torch.equal(payload, _reference_block_payload(name, tensor))  # uint8: bit for bit, non-finite too


@pytest.mark.parametrize("seed, key, ratio, n", [(0, 0, 0.1, 1000), (3, (2, 1), 0.3, 7), (5, "b", 0.01, 10_001)])
def test_randomk_draws_the_same_positions_on_the_cpu(seed, key, ratio, n):
    """The positions are (a*i + b) mod n with a, b from Python's `random` seeded by (seed, key, round): unchanged."""
    codec, k = RandomK(ratio, seed), max(1, math.ceil(n * ratio))
    start, drawn = n, 0
    for _ in range(2 * math.ceil(n / k) + 1):  # two rounds and a call into the third
        if start >= n:
            draw = random.Random(f"{seed}/{key!r}/{drawn}")
            a = draw.randrange(1, n) if n > 1 else 1
            while math.gcd(a, n) != 1:
                a = draw.randrange(1, n)
            b, start, drawn = draw.randrange(n), 0, drawn + 1
        stop = min(start + k, n)
        expected = [(i * a + b) % n for i in range(start, stop)]
        start = stop
        _, (_, index) = codec.compress(torch.ones(n), key)
        assert index.device.type == "cpu" and index.tolist() == expected
