"""int8's and fp4's chunked encoding and decoding (per-thread buffers, no full-size temporary) give the bits of the
whole-tensor operations they replace, at every chunk size, for every output dtype and every way a sum is made."""

import gc
import itertools
import threading
import weakref

import pytest
import torch

from trainaccel.comm.codecs import BlockQuantized, ErrorFeedback, workspace
from trainaccel.comm.exchange import decode

BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
CHUNKS = [1, 3, 1024]  # blocks per chunk: one, a count that splits the last chunk unevenly, the default
SIZES = [1, 256, 257, 5 * 256 + 100]  # one value, one block, a partial second block, several chunks of 1 or 3 blocks


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


def reference_payload(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The whole-tensor encoder the chunked one replaced (`tests/comm/test_devices_codecs.py` pins its bits too)."""
    top, n = (127.0 if name == "int8" else 6.0), tensor.numel()
    blocks = -(-n // 256)
    x = torch.nn.functional.pad(tensor.float(), (0, blocks * 256 - n)).view(blocks, 256)
    scales = x.abs().amax(dim=1) / torch.tensor([top])
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    if name == "int8":
        x = (x / safe[:, None]).nan_to_num_(0.0, 0.0, 0.0)
        codes = x.round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8).reshape(-1)
    else:
        x = (x / safe[:, None]).mul_(4.0).nan_to_num_(0.0, 0.0, 0.0)
        code = BlockQuantized._NEAREST[x.abs().clamp_(max=24.0).to(torch.int64)] | ((x < 0).to(torch.uint8) << 3)
        codes = (code[:, 0::2] | (code[:, 1::2] << 4)).reshape(-1)
    return torch.cat([scales.view(torch.uint8), codes])


def reference_decoded(name: str, payload: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The whole-tensor decoder the chunked one replaced: a lookup of float pairs, times the scales, then `dtype`."""
    blocks = -(-n // 256)
    scales, codes = payload[: 4 * blocks].view(torch.float32), payload[4 * blocks :].view(blocks, -1)
    if name == "int8":
        x = codes.view(torch.int8).float()
    else:
        signed = torch.cat([BlockQuantized.FP4, -BlockQuantized.FP4])
        pairs = torch.stack([signed[torch.arange(256) & 15], signed[torch.arange(256) >> 4]], dim=1)
        x = torch.nn.functional.embedding(codes.to(torch.int64), pairs).view(blocks, 256)
    return x.mul_(scales[:, None]).reshape(-1)[:n].to(dtype)


def inputs(n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    plain = torch.randn(n, generator=g) * 1e-3
    # Every quarter of fp4's range at a block's largest magnitude, signed zeros, a small negative, a non-finite value.
    edges = torch.cat([torch.tensor([6.0]), torch.arange(-24, 25) / 4, torch.tensor([-0.0, -1e-3, float("nan")])])
    edged = torch.randn(n, generator=g) * torch.logspace(-8, 8, n)
    edged[: min(n, edges.numel())] = edges[: min(n, edges.numel())]
    return [plain.to(dtype), edged.to(dtype)]


@pytest.fixture(params=CHUNKS, ids=lambda c: f"chunk{c}")
def chunk(request, monkeypatch):
    monkeypatch.setattr(BlockQuantized, "CHUNK", request.param)
    return request.param


@pytest.mark.parametrize(
    "name, n, dtype",
    itertools.product(["int8", "fp4"], SIZES, [torch.float32, torch.float16, torch.bfloat16]),
)
def test_chunked_encoding_and_decoding_keep_the_whole_tensor_bits(chunk, name, n, dtype):
    codec = BlockQuantized(name)
    for tensor in inputs(n, dtype):
        payload, ctx = codec.compress(tensor)
        assert torch.equal(payload, reference_payload(name, tensor))  # uint8: bit for bit
        expected = reference_decoded(name, payload, n, dtype)
        assert torch.equal(bits(codec.decompress(payload, ctx)), bits(expected))
        out = torch.full((n,), 7.0, dtype=dtype)
        assert codec.decompress_into(payload, ctx, out) is out
        assert torch.equal(bits(out), bits(expected))
        total = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
        wanted = total.clone()
        wanted += expected
        codec.accumulate(payload, ctx, total)
        assert torch.equal(bits(total), bits(wanted))  # `out += decompress(...)`, rounded as that is


@pytest.mark.parametrize(
    "name, dtype, world", itertools.product(["int8", "fp4"], [torch.float32, torch.bfloat16], [2, 3])
)
def test_a_gathered_sum_keeps_the_parts_order_bits_on_every_rank(chunk, name, dtype, world):
    """Each rank reuses its own decoded payload and adds the others in without a temporary: every rank gets the bits
    of decoding every part and summing them in order, into a bucket (`out`) or not."""
    codec, n = BlockQuantized(name), 3 * 256 + 5
    g = torch.Generator().manual_seed(world)
    parts = [codec.compress((torch.randn(n, generator=g) * 10.0 ** (-rank)).to(dtype))[0] for rank in range(world)]
    ctx = (n, dtype, -(-n // 256))
    expected = reference_decoded(name, parts[0], n, dtype)
    for part in parts[1:]:
        expected += reference_decoded(name, part, n, dtype)
    for rank in range(world):
        mine = codec.decompress(parts[rank], ctx)
        assert torch.equal(bits(decode(codec, parts, ctx, None, {rank: mine})), bits(expected))
        out = torch.full((n,), 5.0, dtype=dtype)
        assert torch.equal(bits(decode(codec, parts, ctx, out)), bits(expected))


def test_error_feedback_keeps_what_the_chunked_payload_did_not_carry(chunk):
    feedback, codec = ErrorFeedback(), BlockQuantized("fp4")
    gradient = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    corrected = feedback.correct("k", gradient)
    payload, ctx = codec.compress(corrected, "k")
    sent = feedback.update("k", corrected, codec, payload, ctx)
    assert torch.equal(sent, reference_decoded("fp4", payload, 1000, torch.float32))
    assert torch.equal(feedback.residuals["k"], gradient - sent)


def test_a_workspace_is_kept_per_thread_and_name_and_grows_to_the_largest_request():
    a = workspace("test.a", 100, torch.float32, torch.device("cpu"))
    assert workspace("test.a", 50, torch.float32, torch.device("cpu")).data_ptr() == a.data_ptr()  # reused
    assert workspace("test.b", 50, torch.float32, torch.device("cpu")).data_ptr() != a.data_ptr()  # by name
    assert workspace("test.a", 50, torch.int32, torch.device("cpu")).data_ptr() != a.data_ptr()  # and dtype
    grown = workspace("test.a", 200, torch.float32, torch.device("cpu"))
    assert grown.numel() == 200 and workspace("test.a", 100, torch.float32, torch.device("cpu")).numel() == 100
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(workspace("test.a", 100, torch.float32, grown.device)))
    thread.start()
    thread.join()
    assert elsewhere[0].data_ptr() != grown.data_ptr()  # another thread's own buffer
    meta = workspace("test.a", 100, torch.float32, torch.device("meta"))
    assert meta.device.type == "meta"  # off the CPU: a fresh tensor each time


def test_shutdown_gives_every_threads_workspaces_back():
    import trainaccel

    cpu = torch.device("cpu")
    mine = weakref.ref(workspace("test.release", 1000, torch.float32, cpu)._base)
    theirs, release, done = [], threading.Event(), threading.Event()

    def hold() -> None:  # a thread alive at shutdown (DDP's, the outer sync's)
        theirs.append(weakref.ref(workspace("test.release", 1000, torch.float32, cpu)._base))
        done.set()
        release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        done.wait(10)
        assert mine() is not None and theirs[0]() is not None  # kept between calls
        trainaccel.shutdown()
        gc.collect()
        assert mine() is None and theirs[0]() is None
        assert workspace("test.release", 10, torch.float32, cpu).numel() == 10  # usable again
    finally:
        release.set()
        thread.join()
