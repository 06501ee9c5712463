"""fp16's scales: `dynamic` (halved by an overflow, doubled after a long clean run, per bucket), `peak` (from the
group's largest magnitude, tests/comm/test_fp16_peak.py over real workers) and a fixed one."""

import math

import pytest
import torch

from trainaccel.comm.codecs import CastCompression, get_codec
from trainaccel.config import Config, ConfigError


def test_an_overflow_halves_a_buckets_scale_and_a_clean_run_doubles_it():
    codec = get_codec("fp16", fp16_scale="dynamic")
    assert codec.compress(torch.ones(4), key=0)[1] == (torch.float32, 1.0)
    codec.overflowed(0)
    payload, ctx = codec.compress(torch.full((4,), 3.0), key=0)
    assert ctx == (torch.float32, 0.5) and torch.equal(payload, torch.full((4,), 1.5, dtype=torch.float16))
    assert torch.equal(codec.decompress(payload, ctx), torch.full((4,), 3.0))
    assert codec.compress(torch.ones(4), key=1)[1][1] == 1.0  # another bucket keeps its own
    for _ in range(CastCompression.GROWTH_INTERVAL):
        codec.compress(torch.ones(4), key=0)
    assert codec.compress(torch.ones(4), key=0)[1][1] == 1.0  # 0.5 doubled after GROWTH_INTERVAL clean sums


def test_a_fixed_scale_never_changes():
    codec = get_codec("fp16", fp16_scale=4.0)
    codec.overflowed(0)
    assert codec.compress(torch.ones(2), key=0)[1] == (torch.float32, 4.0)


@pytest.mark.parametrize(
    "raw, value",
    [("auto", "auto"), ("dynamic", "dynamic"), ("DYNAMIC", "dynamic"), (" Peak", "peak"), ("0.5", 0.5), (8, 8.0)],
)
def test_the_option_takes_auto_dynamic_peak_or_a_positive_number(raw, value):
    assert Config.resolve(fp16_scale=raw).fp16_scale == value


@pytest.mark.parametrize("raw", ["automatic", "0", -1, "x", "max"])
def test_the_option_names_what_it_accepts(raw):
    with pytest.raises(ConfigError, match="accepted: auto, dynamic, peak, or a number > 0"):
        Config.resolve(fp16_scale=raw)


def test_gradients_beyond_fp16s_range_fall_back_once_then_compress_at_a_lower_scale(one_process_group):
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainaccel.comm as comm

    ddp = DDP(nn.Linear(4, 1, bias=False))
    state = comm.register(ddp, compression="fp16", hierarchical="off")
    for _ in range(6):
        (ddp(torch.ones(1, 4)) * 98304.0).sum().backward()  # beyond float16 (65504); half of it is a float16
        assert torch.equal(ddp.module.weight.grad, torch.full((1, 4), 98304.0))  # a fallback, or sent at 0.5
        ddp.module.weight.grad = None
    assert state.fallbacks == 1  # step 1 is exact by design, step 2 overflowed at scale 1, steps 3-6 sent at 0.5
    assert state.codec.scales[0][0] == 0.5


@pytest.mark.parametrize("size", [1, 2, 3, 8, 1024])
@pytest.mark.parametrize("peak", [1e-30, 1e-9, 6e-5, 0.37, 1.0, 3.0e4, 65504.0, 1e6, 3e38])
def test_the_peaks_scale_is_the_largest_power_of_two_that_keeps_the_sum_within_range(peak, size):
    codec = get_codec("fp16", fp16_scale="peak")
    scale = float(codec.peak_scale(torch.tensor([peak]), size))
    assert math.frexp(scale)[0] == 0.5  # a power of two: scaling and unscaling are exact
    if peak * size * CastCompression.PEAK_HIGHEST <= CastCompression.PEAK_TARGET:
        assert scale == CastCompression.PEAK_HIGHEST  # capped: a tiny peak is brought up that far, no further
    else:
        assert peak * size * scale <= CastCompression.PEAK_TARGET < 2 * peak * size * scale


@pytest.mark.parametrize("peak, scale", [(0.0, CastCompression.PEAK_HIGHEST), (float("inf"), 1.0)])
def test_a_zero_peak_gets_a_finite_scale_and_a_non_finite_one_is_sent_unscaled(peak, scale):
    # An all-zero bucket must not be multiplied by infinity (0 * inf is NaN); a non-finite gradient is passed on
    # where it is (`group_peak` turns NaN into +inf), as plain DDP's sum would.
    assert float(get_codec("fp16", fp16_scale="peak").peak_scale(torch.tensor([peak]), 4)) == scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_peak_scaled_payload_is_scaled_before_the_cast_and_decodes_exactly(dtype):
    codec = get_codec("fp16", fp16_scale="peak")
    values = torch.tensor([1e-7, -3e-6, 2.5e-4, 0.0], dtype=dtype)  # below float16's normal range at scale 1
    scale = codec.peak_scale(values.abs().max().float().reshape(1), 2)
    payload, ctx = codec.compress(values, key=0, scale=scale)
    assert payload.dtype == torch.float16 and ctx[0] == dtype
    expected = (values.double() * float(scale)).to(torch.float16)  # scaled first: no value flushed by the cast
    assert torch.equal(payload, expected) and bool((payload[:3] != 0).all())
    assert torch.equal(codec.decompress(payload, ctx), (expected.double() / float(scale)).to(dtype))
    out = torch.empty_like(values)
    assert torch.equal(codec.decompress_into(payload, ctx, out), codec.decompress(payload, ctx))


def test_a_peak_scaled_codec_refuses_to_encode_without_the_groups_scale():
    with pytest.raises(ValueError, match="needs the group's scale"):
        get_codec("fp16", fp16_scale="peak").compress(torch.ones(4), key=0)


def test_a_peak_scaled_codec_needs_no_host_read_to_choose_a_retry():
    from trainaccel.comm.exchange import needs_check

    assert not needs_check(get_codec("fp16", fp16_scale="peak"))
    assert needs_check(get_codec("fp16", fp16_scale="dynamic")) and needs_check(get_codec("fp16", fp16_scale=1.0))


def test_auto_is_peak_on_an_accelerator_and_dynamic_on_the_cpu():
    assert Config.resolve().fp16_scale == "auto"
    assert get_codec("fp16", fp16_scale="auto").dynamic  # no device: the CPU
    assert get_codec("fp16", fp16_scale="auto", device=torch.device("cpu")).dynamic
    assert get_codec("fp16", fp16_scale="auto", device=torch.device("cuda", 0)).by_peak
    assert get_codec("fp16", fp16_scale="auto", device=torch.device("meta")).by_peak
