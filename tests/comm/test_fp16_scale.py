"""fp16's dynamic scale: halved by an overflow, doubled after a long clean run, per bucket."""

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


@pytest.mark.parametrize("raw, value", [("dynamic", "dynamic"), ("DYNAMIC", "dynamic"), ("0.5", 0.5), (8, 8.0)])
def test_the_option_takes_dynamic_or_a_positive_number(raw, value):
    assert Config.resolve(fp16_scale=raw).fp16_scale == value


@pytest.mark.parametrize("raw", ["auto", "0", -1, "x"])
def test_the_option_names_what_it_accepts(raw):
    with pytest.raises(ConfigError, match="accepted: dynamic, or a number > 0"):
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
