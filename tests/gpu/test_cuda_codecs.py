"""Every codec on CUDA tensors: payloads stay on the GPU, decode to what the CPU decodes, keep residuals there, and
go through a real exchange (a Gloo and an NCCL group of one rank)."""

import pytest
import torch
import torch.distributed as dist

from trainaccel.comm.codecs import CODECS, BlockQuantized, ErrorFeedback, get_codec
from trainaccel.comm.exchange import decode, start_exchange

pytestmark = pytest.mark.gpu

LOSSY = [name for name in CODECS if get_codec(name).lossy]
N = 10_000  # not a multiple of int8/fp4's block of 256: the padded tail is exercised


def gradient(seed: int = 0) -> torch.Tensor:
    """A gradient-like buffer: mostly small values, a few large, one exact zero, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, generator=g) * 1e-3
    x[::97] *= 300.0
    x[5] = 0.0
    return x


@pytest.mark.parametrize("name", CODECS)
def test_a_round_trip_on_the_gpu_stays_there_and_decodes_as_on_the_cpu(name, device):
    x = gradient()
    on_cpu, on_gpu = get_codec(name, ratio=0.05), get_codec(name, ratio=0.05)
    payload, ctx = on_gpu.compress(x.to(device), key=0)
    assert payload.device == device, f"{name}'s payload left the GPU"
    decoded = on_gpu.decompress(payload, ctx)
    assert decoded.device == device and decoded.dtype == x.dtype and decoded.shape == x.shape
    expected = on_cpu.decompress(*on_cpu.compress(x.clone(), key=0))
    # The same rounding on both devices (IEEE division and casts, the same top-k set, the same random positions).
    assert torch.equal(decoded.cpu(), expected), f"{name} decodes differently on the GPU"


@pytest.mark.parametrize("name", ["int8", "fp4"])
def test_a_block_payload_and_sum_on_the_gpu_are_the_cpus_chunked_ones(name, device):
    """The CPU encodes and decodes in chunks of `CHUNK` blocks, the GPU each pass at once: the same bits."""
    n = 2 * BlockQuantized.CHUNK * BlockQuantized.BLOCK + 1000  # three chunks on the CPU, the last partial
    x = torch.randn(n, generator=torch.Generator().manual_seed(5)) * 1e-3
    # Zero signs, and a block whose scale is infinite (a NaN input's scale would carry that NaN's device-made bits).
    x[:5] = torch.tensor([-0.0, 0.0, -1e-9, 6e-3, float("inf")])
    codec = get_codec(name)
    on_cpu, ctx = codec.compress(x)
    on_gpu, gpu_ctx = codec.compress(x.to(device))
    assert torch.equal(on_gpu.cpu(), on_cpu), f"{name} encodes differently on the GPU"
    other = codec.compress(torch.randn(n, generator=torch.Generator().manual_seed(6)))[0]
    expected = decode(codec, [on_cpu, other], ctx)
    summed = decode(codec, [on_gpu, other.to(device)], gpu_ctx)
    summed, nan = summed.cpu(), expected.isnan()
    # A NaN made on the device (inf x 0) has that device's bits: its place must agree, every other value's bits.
    assert torch.equal(summed.isnan(), nan) and bool(nan.any())
    assert torch.equal(summed[~nan].view(torch.int32), expected[~nan].view(torch.int32))


@pytest.mark.parametrize("name", LOSSY)
def test_error_feedback_keeps_what_was_not_sent_on_the_gpu(name, device):
    x = gradient(1).to(device)
    codec, feedback = get_codec(name, ratio=0.05), ErrorFeedback()
    corrected = feedback.correct("bucket", x)
    payload, ctx = codec.compress(corrected, "bucket")
    feedback.update("bucket", corrected, codec, payload, ctx)
    residual = feedback.residuals["bucket"]
    assert residual.device == device
    sent = codec.decompress(payload, ctx)
    torch.testing.assert_close(sent + residual, x)  # what was sent plus what waits is the gradient
    if name in ("topk", "randomk"):  # sparse codecs also decode into a buffer (`accumulate`) on the GPU
        out = torch.zeros_like(x)
        codec.accumulate(payload, ctx, out)
        assert torch.equal(out, sent)


@pytest.fixture(params=["gloo", "nccl"])
def one_rank_group(request, device, tmp_path):
    """A process group of one rank over `request.param`, ended after the test."""
    if request.param == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
        pytest.skip("NCCL needs CUDA")
    dist.init_process_group(request.param, store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("name", CODECS)
def test_an_exchange_of_gpu_buffers_sums_on_the_gpu(name, device, one_rank_group):
    x = gradient(2)
    codec = get_codec(name, ratio=0.05)
    feedback = ErrorFeedback() if codec.lossy else None
    outcome = start_exchange(codec, feedback, x.to(device), 0, one_rank_group).finish()
    assert outcome.fallback is None
    assert outcome.result.device == device
    # One rank: the sum is this rank's own payload, decoded.
    reference = get_codec(name, ratio=0.05)
    expected = reference.decompress(*reference.compress(x.clone(), key=0))
    assert torch.equal(outcome.result.cpu(), expected)
    if feedback is not None:
        assert all(r.device == device for r in feedback.residuals.values())


def test_topk_on_a_large_gpu_buffer_takes_the_exact_top_k(device):
    # On the CPU a sampled threshold stands in for a full top-k above 65536 elements; on the GPU never (it would
    # stop the host at every bucket). Exact: the k largest magnitudes, however the shortcut would have drawn.
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)).to(device)
    codec = get_codec("topk", ratio=0.01)
    payload, ctx = codec.compress(x)
    sent = codec.decompress(payload, ctx)
    assert (sent != 0).sum().item() == 10486  # ceil(1% of 2**20)
    threshold = x.abs().topk(10486).values.min()
    assert torch.equal(sent != 0, x.abs() >= threshold)
