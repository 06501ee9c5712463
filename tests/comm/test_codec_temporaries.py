"""The casts' paths without full-size temporaries give the bits of the paths with them, and the finiteness check
without a mask the answer of `isfinite().all()`."""

import itertools

import pytest
import torch

from trainaccel.comm.codecs import CastCompression, ErrorFeedback, workspace
from trainaccel.comm.exchange import all_finite, decode, start_exchange

BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16}
CODECS = {"fp16": torch.float16, "bf16": torch.bfloat16}
SCALES = [1.0, 2.0**10, 2.0**-7, 3.0, 0.1]  # powers of two, and two that are not


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


def gradient(dtype: torch.dtype) -> torch.Tensor:
    g = torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 3
    g[:6] = torch.tensor([0.0, -0.0, 1e-9, -3e-8, 7e4, -1e-3])  # signed zeros, values below fp16's range, above it
    return g.to(dtype)


def codec(name: str, scale: float | str) -> CastCompression:  # a number, or "dynamic"
    return CastCompression(name, CODECS[name], scale=scale)


@pytest.mark.parametrize("name, scale, dtype", itertools.product(CODECS, SCALES, [torch.float32, torch.float16]))
def test_decoding_into_a_buffer_gives_decompress_bits(name, scale, dtype):
    c = codec(name, scale)
    payload, ctx = c.compress(gradient(dtype))
    out = torch.full_like(gradient(dtype), 123.0)
    assert c.decompress_into(payload, ctx, out) is out
    assert torch.equal(bits(out), bits(c.decompress(payload, ctx)))
    # As the exchange decodes a summed payload into its bucket.
    again = torch.zeros_like(out)
    assert torch.equal(bits(decode(c, [payload], ctx, again)), bits(c.decompress(payload, ctx)))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize(
    "name, scale, dtype",
    itertools.product(CODECS, SCALES, [torch.float32, torch.float64, torch.float16, torch.bfloat16]),
)
def test_error_feedback_keeps_what_was_not_sent_to_the_bit_and_decodes_into_one_buffer(name, scale, dtype, momentum):
    c, feedback = codec(name, scale), ErrorFeedback(momentum)
    for key, n in [("large", 4099), ("small", 1000), ("large", 4099)]:  # the scratch buffer serves both sizes
        corrected = feedback.correct(key, gradient(dtype)[:n], 0.5)
        payload, ctx = c.compress(corrected, key)
        sent = c.decompress(payload, ctx)
        expected = corrected.clone().sub_(sent)
        if c.keeps_finiteness:  # what a non-finite value left is dropped (7e4 is beyond a float16 buffer)
            expected.nan_to_num_(0.0, 0.0, 0.0)
        assert feedback.update(key, corrected, c, payload, ctx) is None  # a summed payload's own decode is not kept
        assert torch.equal(bits(feedback.residuals[key]), bits(expected))
        if momentum:  # momentum factor masking cleared what was sent
            assert not feedback.velocities[key][sent != 0].any()
    # One buffer of the thread's, of the largest size, served both keys.
    kept = workspace("feedback.sent", 1, dtype, torch.device("cpu"))
    assert kept.untyped_storage().nbytes() >= 4099 * kept.element_size()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("poison", [None, float("inf"), float("-inf"), float("nan"), "both infinities"])
def test_the_finiteness_check_without_a_mask_answers_as_isfinite(dtype, poison):
    big = torch.finfo(dtype).max
    values = torch.full((10_000,), big, dtype=dtype)  # finite values whose sum overflows the dtype itself
    values[1::2] = big / 3
    if poison == "both infinities":
        values[3], values[7] = float("inf"), float("-inf")  # sum to NaN, not to a finite value
    elif poison is not None:
        values[5] = poison
    assert bool(all_finite(values)) == bool(values.isfinite().all()) == (poison is None)


def test_integer_payloads_are_finite():
    assert bool(all_finite(torch.arange(10, dtype=torch.uint8)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale", [4.0, 2.0**-3, 3.0, "dynamic"])
def test_a_scaled_cast_carries_the_sum_for_a_buffer_of_any_dtype(one_process_group, dtype, scale):
    """World size 1: the sum is the input, as float16 carries it. Decoding for error feedback once divided a float16
    buffer's payload in place before it was sent, and every sum came out divided by the scale."""
    c = codec("fp16", scale)
    if scale == "dynamic":
        c.scales["k"] = [1.0, CastCompression.GROWTH_INTERVAL]  # the next sum doubles the scale: 2
    t = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    reference = codec("fp16", 2.0 if scale == "dynamic" else scale)
    payload, ctx = reference.compress(t.clone())
    before = payload.clone()
    expected = reference.decompress(payload, ctx)
    assert torch.equal(payload, before)  # decoding leaves the payload as it was
    got = start_exchange(c, ErrorFeedback(), t.clone(), "k", None).finish().result
    assert got.dtype == dtype and torch.equal(bits(got), bits(expected))
