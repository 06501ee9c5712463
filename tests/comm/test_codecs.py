"""Codecs and error feedback in one process, against exact references."""

import pytest
import torch

from trainaccel.comm.codecs import CastCompression, ErrorFeedback, RandomK, TopK, get_codec


def test_topk_sampled_threshold_picks_exactly_the_largest():
    t = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0))
    codec = TopK(0.01)
    payload, ctx = codec.compress(t)  # large enough for the sampled-threshold path
    k = payload.numel() // 2
    assert k == 10_000 and payload.dtype == torch.float32
    sent = payload[k:].view(torch.int32).long()
    assert set(sent.tolist()) == set(t.abs().topk(k).indices.tolist())
    assert torch.equal(payload[:k], t[sent])
    assert torch.equal(codec.decompress(payload, ctx)[sent], t[sent])


def test_topk_accumulate_and_zero_sent_agree_with_decompress():
    t = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    codec = TopK(0.1)
    payload, ctx = codec.compress(t)
    out = torch.ones(5000)
    codec.accumulate(payload, ctx, out)
    assert torch.allclose(out, 1 + codec.decompress(payload, ctx))
    rest = t.clone()
    codec.zero_sent(rest, payload, ctx)
    assert torch.equal(rest, t - codec.decompress(payload, ctx))


def test_randomk_rounds_send_every_element_once_per_n_calls():
    codec, t = RandomK(0.25), torch.arange(1.0, 101.0)
    covered = torch.zeros(100)
    offsets = []
    for _ in range(4):
        payload, ctx = codec.compress(t)
        offsets.append(ctx[1])
        codec.accumulate(payload, ctx, covered)
    assert sorted(offsets) == [0, 1, 2, 3]
    assert torch.equal(covered, t)  # each element exactly once in a round of N = 4
    assert RandomK(0.25, seed=3).compress(t)[1] == RandomK(0.25, seed=3).compress(t)[1]  # shared seed, same pick


def test_fp16_scale_keeps_small_gradients_from_underflowing():
    tiny = torch.full((8,), 1e-8)
    plain, scaled = CastCompression("fp16", torch.float16), CastCompression("fp16", torch.float16, 1024.0)
    assert plain.decompress(*plain.compress(tiny)).abs().max() == 0  # below fp16's smallest subnormal
    assert torch.allclose(scaled.decompress(*scaled.compress(tiny)), tiny, rtol=1e-2)


def test_error_feedback_keeps_exactly_what_was_not_sent():
    feedback, codec = ErrorFeedback(), TopK(0.1)
    g1, g2 = torch.randn(1000), torch.randn(1000)
    corrected = feedback.correct("b", g1)
    payload, ctx = codec.compress(corrected)
    sent1 = codec.decompress(payload, ctx)
    feedback.update("b", corrected, codec, payload, ctx)
    assert torch.allclose(feedback.residuals["b"], g1 - sent1)
    corrected = feedback.correct("b", g2, scale=0.5)
    assert torch.allclose(corrected, g1 - sent1 + 0.5 * g2)


def test_error_feedback_momentum_correction():
    feedback, codec = ErrorFeedback(momentum=0.9), RandomK(0.5)
    g = torch.ones(4)
    corrected = feedback.correct("b", g)
    payload, ctx = codec.compress(corrected)
    feedback.update("b", corrected, codec, payload, ctx)
    kept = torch.ones(4, dtype=torch.bool)
    kept[ctx[1] :: 2] = False
    assert torch.equal(feedback.velocities["b"], torch.where(kept, 1.0, 0.0))  # cleared where sent
    corrected = feedback.correct("b", g)  # u = 0.9u + g; residual += u
    assert torch.allclose(corrected, torch.where(kept, 1.0 + 1.9, 1.0))


def test_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="invalid compression='lz4'; accepted: none, fp16, bf16, topk, randomk"):
        get_codec("lz4")
