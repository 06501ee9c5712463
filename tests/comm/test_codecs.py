"""Codecs and error feedback in one process, against exact references."""

import math

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


@pytest.mark.parametrize("ratio, n", [(0.25, 100), (0.4, 100), (0.01, 10_001), (0.3, 7), (1.0, 5)])
def test_randomk_sends_the_exact_ratio_and_covers_every_element_once_per_round(ratio, n):
    codec, t = RandomK(ratio), torch.arange(1.0, n + 1.0)
    k = math.ceil(n * ratio)
    calls = math.ceil(n / k)  # one round
    covered = torch.zeros(n)
    for call in range(calls):
        payload, ctx = codec.compress(t, key=3)
        assert payload.numel() - 1 == (k if call < calls - 1 else n - k * (calls - 1))  # values, then the flag
        assert payload[-1] == 0  # every element finite
        codec.accumulate(payload, ctx, covered)
    assert torch.equal(covered, t)  # each element exactly once per round


def test_randomk_keeps_a_round_per_bucket_and_every_rank_draws_alike():
    a, b = RandomK(0.5, seed=3), RandomK(0.5, seed=3)
    t = torch.arange(1.0, 11.0)
    # Two buckets of one size: each has a round of its own (the old per-size round let them share one).
    first = [a.compress(t, key=0)[1][1], a.compress(t, key=1)[1][1]]
    second = [a.compress(t, key=0)[1][1], a.compress(t, key=1)[1][1]]
    for bucket in (0, 1):
        assert sorted(torch.cat([first[bucket], second[bucket]]).tolist()) == list(range(10))
    assert torch.equal(b.compress(t, key=0)[1][1], first[0])  # the same seed: the same elements on every rank
    assert not torch.equal(RandomK(0.5, seed=4).compress(t, key=0)[1][1], first[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_randomk_flags_a_non_finite_element_it_does_not_send(bad):
    codec, twin, t = RandomK(0.1), RandomK(0.1), torch.ones(100)
    payload, ctx = codec.compress(t, key=0)
    twin.compress(t, key=0)
    sent = set(ctx[1].tolist()) | set(twin.compress(t, key=0)[1][1].tolist())  # by this call and the next
    unsent = next(i for i in range(100) if i not in sent)
    t[unsent] = bad
    payload, ctx = codec.compress(t, key=0)
    assert payload[:-1].isfinite().all() and payload[-1].isnan()


@pytest.mark.parametrize("dtype, codec", [(torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp16")])
def test_a_cast_payload_never_shares_memory_with_its_input(dtype, codec):
    # A float16 model under fp16: the cast is a no-op, and error feedback must still see a copy.
    t = torch.randn(64).to(dtype)
    payload, ctx = get_codec(codec).compress(t)
    assert payload.data_ptr() != t.data_ptr()
    feedback, c = ErrorFeedback(), get_codec(codec)
    corrected = feedback.correct("b", t)
    payload, ctx = c.compress(corrected)
    feedback.update("b", corrected, c, payload, ctx)
    assert payload.abs().sum() > 0  # the gradient is sent, not zeroed with the residual
    if dtype == getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[codec]):
        assert torch.equal(payload, t) and feedback.residuals["b"].abs().max() == 0


def test_clear_forgets_residual_and_velocity():
    feedback, codec = ErrorFeedback(momentum=0.9), TopK(0.1)
    corrected = feedback.correct("b", torch.randn(100))
    payload, ctx = codec.compress(corrected)
    feedback.update("b", corrected, codec, payload, ctx)
    feedback.clear("b")
    assert feedback.residuals["b"].abs().max() == 0 and feedback.velocities["b"].abs().max() == 0


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
    payload, ctx = codec.compress(corrected, key="b")
    feedback.update("b", corrected, codec, payload, ctx)
    kept = torch.ones(4, dtype=torch.bool)
    kept[ctx[1]] = False
    assert torch.equal(feedback.velocities["b"], torch.where(kept, 1.0, 0.0))  # cleared where sent
    corrected = feedback.correct("b", g)  # u = 0.9u + g; residual += u
    assert torch.allclose(corrected, torch.where(kept, 1.0 + 1.9, 1.0))


@pytest.mark.parametrize("nesterov, dampening", [(False, 0.0), (True, 0.0), (False, 0.3)])  # torch: no both
def test_taken_over_momentum_sends_what_torch_sgd_would_apply(nesterov, dampening):
    """Without masking, with everything sent: the payloads are torch SGD's steps, from a carried-over buffer on."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.zeros(50))
    sgd = torch.optim.SGD([param], lr=1.0, momentum=0.9, nesterov=nesterov, dampening=dampening)
    grads = [torch.randn(50) for _ in range(6)]
    for g in grads[:2]:  # two steps of the optimizer's own, then its buffer moves into the feedback
        param.grad = g.clone()
        sgd.step()
    feedback = ErrorFeedback(0.9, nesterov=nesterov, dampening=dampening, masking=False)
    carried, codec = sgd.state[param]["momentum_buffer"].clone(), TopK(1.0)
    for g in grads[2:]:
        before = param.detach().clone()
        param.grad = g.clone()
        sgd.step()
        corrected = feedback.correct("b", g, velocity=carried)
        payload, ctx = codec.compress(corrected)
        feedback.update("b", corrected, codec, payload, ctx)
        assert torch.allclose(codec.decompress(payload, ctx), before - param.detach(), atol=1e-6)
        assert feedback.residuals["b"].abs().max() == 0 and feedback.velocities["b"].abs().max() > 0


def test_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="invalid compression='lz4'; accepted: none, fp16, bf16, topk, randomk"):
        get_codec("lz4")


def test_adaptive_ratio_moves_by_the_lag_every_few_exchanges(one_process_group):
    import torch.distributed as dist

    from trainaccel.comm.adaptive import HIGH, LOW, AdaptiveRatio

    adaptive, g = AdaptiveRatio(0.01, 0.08, every=2), torch.ones(100)
    assert adaptive.ratio("b") == 0.01
    lagging = g * (HIGH + 1)  # holds back more than HIGH steps of this gradient
    adaptive.measure("b", lagging, g, 1.0, dist.group.WORLD)
    assert adaptive.ratio("b") == 0.01  # measured every 2nd exchange only
    for expected in (0.02, 0.04, 0.08, 0.08):  # doubles up to the upper bound
        adaptive.measure("b", lagging, g, 1.0, dist.group.WORLD)
        adaptive.measure("b", lagging, g, 1.0, dist.group.WORLD)
        assert adaptive.ratio("b") == expected
    between = g * (LOW + HIGH) / 2
    adaptive.measure("b", between, g, 1.0, dist.group.WORLD)
    adaptive.measure("b", between, g, 1.0, dist.group.WORLD)
    assert adaptive.ratio("b") == 0.08  # neither lagging nor safe: kept
    for expected in (0.04, 0.02, 0.01, 0.01):  # the gradient is scaled by 0.5 before comparing: lag 1 < LOW
        adaptive.measure("b", g * 0.5, g, 1.0, dist.group.WORLD)
        adaptive.measure("b", g * 0.5, g, 1.0, dist.group.WORLD)
        assert adaptive.ratio("b") == expected
    assert adaptive.ratio("other") == 0.01  # per bucket
    with pytest.raises(ValueError, match="accepted: 0 < low < high <= 1"):
        AdaptiveRatio(0.1, 0.05)


@pytest.mark.parametrize("name, bytes_per_value, worst", [("int8", 1.0, 0.5 / 127), ("fp4", 0.5, 1.0 / 6)])
@pytest.mark.parametrize("n", [1, 255, 256, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_block_codecs_round_to_the_nearest_code_within_half_a_step(name, bytes_per_value, worst, n, dtype):
    codec = get_codec(name)
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3).to(dtype)
    payload, ctx = codec.compress(x)
    blocks = -(-n // 256)
    assert payload.dtype == torch.uint8 and payload.numel() == 4 * blocks + int(256 * blocks * bytes_per_value)
    y = codec.decompress(payload, ctx)
    assert y.dtype == dtype and y.shape == x.shape
    # Within half the widest gap between codes, relative to each block's largest magnitude (fp4: 4 -> 6).
    for start in range(0, n, 256):
        block = x[start : start + 256].float()
        err = (block - y[start : start + 256].float()).abs().max()
        assert err <= worst * block.abs().max() * 1.01 + 1e-3 * float(torch.finfo(dtype).eps)


@pytest.mark.parametrize("name", ["int8", "fp4"])
def test_block_codecs_send_their_codes_exactly_and_flag_non_finite_input(name):
    codec = get_codec(name)
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0]) if name == "fp4" else torch.arange(-127.0, 128.0)
    x = codes * 0.25  # a block whose largest magnitude is the largest code: every value is a code times the scale
    payload, ctx = codec.compress(x)
    assert torch.equal(codec.decompress(payload, ctx), x)
    zeros = torch.zeros(300)
    assert torch.equal(codec.decompress(*codec.compress(zeros)), zeros)
    x[3] = float("nan")
    assert not bool(codec.values(codec.compress(x)[0]).isfinite().all())
    x[3] = float("inf")
    assert not bool(codec.values(codec.compress(x)[0]).isfinite().all())
    # Subnormal blocks (a residual that has almost nothing left): finite codes, within half a step.
    tiny = torch.tensor([1e-40, -3e-41, 0.0, 2e-45] * 64)
    decoded = codec.decompress(*codec.compress(tiny))
    assert bool(decoded.isfinite().all()) and float((decoded - tiny).abs().max()) <= 1e-40


def _sum_through(codec, inputs):
    """What every rank decodes from `inputs` (one per rank) summed through `codec`."""
    from trainaccel.comm.exchange import decode

    encoded = [codec.compress(t.clone(), "key") for t in inputs]
    payloads = [p for p, _ in encoded]
    parts = [torch.stack(payloads).sum(0)] if codec.summable else payloads
    return decode(codec, parts, encoded[0][1])


FINITENESS = [
    ("bf16", torch.float32),
    ("bf16", torch.bfloat16),
    ("int8", torch.float32),
    ("fp4", torch.float32),
]


@pytest.mark.parametrize("name, dtype", FINITENESS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [0, 777, 4095])
def test_codecs_that_skip_the_host_check_show_every_non_finite_input_in_the_sum(name, dtype, bad, where):
    # What skipping the host read relies on: a non-finite gradient on any rank makes the decoded sum non-finite
    # (a GradScaler then skips the step, as under plain DDP), and the residual keeps nothing of it.
    codec = get_codec(name)
    assert codec.keeps_finiteness
    g = torch.Generator().manual_seed(where)
    inputs = [torch.randn(4096, generator=g).to(dtype) for _ in range(3)]
    inputs[1][where] = bad
    assert not _sum_through(codec, inputs).isfinite().all()
    feedback = ErrorFeedback(momentum=0.9)
    corrected = feedback.correct("key", inputs[1], 1.0)
    payload, ctx = codec.compress(corrected, "key")
    feedback.update("key", corrected, codec, payload, ctx)
    assert feedback.residuals["key"].isfinite().all() and feedback.velocities["key"].isfinite().all()


@pytest.mark.parametrize("name, dtype", FINITENESS)
def test_codecs_that_skip_the_host_check_keep_finite_sums_finite(name, dtype):
    # Gradients near the dtype's largest value (divided by the world size, as the engine sends them, with a factor
    # of 2 for the rounding of a narrower payload at the top of the range) and subnormals.
    top = torch.finfo(dtype).max / 8
    inputs = [torch.tensor([top, -top, 1e-40, 0.0, 3.0] * 100, dtype=dtype) for _ in range(4)]
    assert _sum_through(get_codec(name), inputs).isfinite().all()


def test_codecs_that_keep_the_host_check_need_it():
    # float16 overflows where the exact float32 sum does not; random-k leaves a non-finite element out of its values
    # (only its flag element, which the check reads, tells of it); top-k's residual keeps most of a gradient, which a
    # non-finite step must clear on every rank.
    assert not any(get_codec(name).keeps_finiteness for name in ("fp16", "randomk", "topk"))
    assert get_codec("bf16").keeps_finiteness and not CastCompression("bf16", torch.bfloat16, 2.0).keeps_finiteness
    assert not _sum_through(get_codec("fp16"), [torch.full((8,), 40000.0)] * 2).isfinite().all()
    hidden = torch.tensor([5.0] * 99 + [math.nan])
    assert 99 not in RandomK(0.01).compress(hidden, "key")[1][1].tolist()  # the same draw as `_sum_through`'s
    assert _sum_through(RandomK(0.01), [hidden, hidden]).isfinite().all()


@pytest.mark.parametrize(
    "name, world, warned",
    [("int8", 4, False), ("int8", 8, True), ("fp4", 8, False), ("fp4", 16, True), ("topk", 64, False)],
)
def test_a_gathered_codec_says_when_it_receives_more_than_a_float32_allreduce(name, world, warned, caplog):
    # int8 receives (world - 1) x 1.02 bytes per element, fp4 (world - 1) x 0.52, top-k at 1% (world - 1) x 0.08; a
    # ring allreduce of float32 2 x 4 x (world - 1) / world: int8 costs more from 8 workers, fp4 from 16.
    from trainaccel.comm.exchange import warn_if_gathering_costs_more

    with caplog.at_level("WARNING", logger="trainaccel"):
        warn_if_gathering_costs_more(get_codec(name), world, "gradient")
        for summable in ("fp16", "bf16", "randomk"):
            warn_if_gathering_costs_more(get_codec(summable), 1024, "gradient")
    said = [r.getMessage() for r in caplog.records if "gathers every worker's payload" in r.getMessage()]
    assert len(said) == warned and all(f"compression={name} " in m for m in said), said


@pytest.mark.parametrize("name", ["int8", "fp4", "topk", "randomk"])
def test_error_feedback_hands_the_gathered_sum_its_own_payload_decoded(name):
    # The sum reuses what error feedback decoded of this rank's payload: it must be that payload's decoding, bit for
    # bit, and the sum made with it the sum made without (sparse codecs decode nothing there: None).
    codec, feedback = get_codec(name, ratio=0.1), ErrorFeedback()
    g = torch.Generator().manual_seed(11)
    corrected = feedback.correct("key", torch.randn(1000, generator=g))
    payload, ctx = codec.compress(corrected, "key")
    mine = feedback.update("key", corrected, codec, payload, ctx)
    if getattr(codec, "zero_sent", None) is not None:
        assert mine is None
        return
    assert torch.equal(mine, codec.decompress(payload, ctx))
    from trainaccel.comm.exchange import decode

    parts = [
        codec.compress(torch.randn(1000, generator=g))[0],
        payload,
        codec.compress(torch.randn(1000, generator=g))[0],
    ]
    assert torch.equal(decode(codec, parts, ctx, decoded={1: mine}), decode(codec, parts, ctx))
