"""Gradient codecs: `compress(tensor) -> (payload, ctx)` and `decompress(payload, ctx) -> tensor`.

A codec sees a flat gradient buffer already divided by the world size. When `summable`, the
payloads of all workers are summed by allreduce and decoded once; otherwise each worker's
payload is gathered, decoded and the results summed. What a lossy codec drops is kept by
`ErrorFeedback` and added into the next step. To spare full-size temporaries, sparse and block
codecs offer `accumulate` (add a decoded payload into a tensor), casts and block codecs
`decompress_into` (decode into a given tensor), sparse codecs `zero_sent`; `values` is the part of
a payload holding values, for the finiteness check. A payload never shares memory
with the tensor it encodes: error feedback changes that tensor after compressing it.
"""

from __future__ import annotations

import math
import random
import sys
import threading
import weakref
from typing import Any, Protocol

import torch

from trainaccel import context
from trainaccel.comm.adaptive import AdaptiveRatio


class Codec(Protocol):
    name: str
    summable: bool  # payloads may be summed by allreduce (else: gathered and decoded one by one)
    lossy: bool  # decompress(compress(t)) differs from t: error feedback applies
    # The decoded sum is finite exactly when the exact sum is (finite inputs never overflow the payload, a non-finite
    # one always shows in the sum): then no host read is needed to choose an exact retry (`exchange.needs_check`).
    keeps_finiteness: bool

    def compress(self, tensor: torch.Tensor, key: Any = None) -> tuple[torch.Tensor, Any]: ...

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class NoCompression:
    """Send the buffer as it is (lossless; no error feedback, so the payload may be the buffer)."""

    name, summable, lossy, keeps_finiteness = "none", True, False, True

    def compress(self, tensor: torch.Tensor, key: Any = None) -> tuple[torch.Tensor, Any]:
        return tensor, None

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        return payload


class CastCompression:
    """Send the buffer in a narrower float dtype, times a scale; restore dtype and scale after.

    `scale="dynamic"` keeps a scale per buffer (by `key`), as GradScaler does for a loss: it starts
    at 1, halves when a sum overflowed (`overflowed`), doubles after `GROWTH_INTERVAL` clean sums.
    `scale="peak"` takes each sum's scale from the largest magnitude over the group (`peak_scale`, given to
    `compress` by the exchange), so that the sum cannot overflow and no host read has to look.
    """

    summable, lossy = True, True
    GROWTH_INTERVAL, LOWEST, HIGHEST = 2000, 2.0**-24, 2.0**24
    # `peak`: the sum's largest magnitude is scaled to at most this, float16's range (65504) with room for its roundings
    PEAK_TARGET, PEAK_HIGHEST = 2.0**15, 2.0**100

    def __init__(self, name: str, dtype: torch.dtype, scale: float | str = 1.0):
        self.name, self.dtype = name, dtype
        self.dynamic = scale == "dynamic"
        self.by_peak = scale == "peak"
        self.scale = 1.0 if self.dynamic or self.by_peak else float(scale)
        # bfloat16 has float32's range: unscaled, its sums overflow where float32's do (give or take one rounding at
        # the very top of that range). float16's overflow much sooner, and a scale may push bfloat16 beyond it; a
        # scale from the peak keeps finite sums finite, and passes a non-finite gradient on (`peak_scale`).
        self.keeps_finiteness = self.by_peak or (dtype == torch.bfloat16 and self.scale == 1.0 and not self.dynamic)
        # Per key: [scale, sums since the last change]; equal on every rank (every rank sees the same sums).
        self.scales: dict[Any, list] | None = {} if self.dynamic else None

    def scale_for(self, key: Any) -> float:
        if self.scales is None:
            return self.scale
        entry = self.scales.setdefault(key, [1.0, 0])
        entry[1] += 1
        if entry[1] > self.GROWTH_INTERVAL and entry[0] < self.HIGHEST:
            entry[0], entry[1] = entry[0] * 2.0, 1
        return entry[0]

    def overflowed(self, key: Any) -> None:
        """A sum of `key`'s payloads was not finite: halve its scale (dynamic only)."""
        if self.scales is not None:
            entry = self.scales.setdefault(key, [1.0, 0])
            entry[0], entry[1] = max(self.LOWEST, entry[0] / 2.0), 0

    def peak_scale(self, peak: torch.Tensor, size: int) -> torch.Tensor:
        """The power of two that keeps a sum of `size` payloads within range, from the group's largest magnitude
        `peak` (a float32 tensor on the device, +inf if any value is not finite: then 1, so that the non-finite
        values reach the sum where they are, as plain DDP's)."""
        # Divided in this order: `peak * size` would overflow float32 for a peak near its largest value (then 0).
        scale = torch.exp2(torch.floor(torch.log2(self.PEAK_TARGET / size / peak))).clamp_(max=self.PEAK_HIGHEST)
        # 0-dim: a float16 payload divided by it stays float16 (a one-element 1-D float32 tensor would promote it)
        return torch.where(peak.isfinite(), scale, torch.ones_like(scale)).reshape(())

    def compress(
        self, tensor: torch.Tensor, key: Any = None, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any]:
        """`scale`: `peak_scale`'s, which `scale="peak"` needs (every rank of a sum must use the same)."""
        if self.by_peak:
            if scale is None:
                raise ValueError(
                    f"{self.name} with scale='peak' needs the group's scale (peak_scale); exchange.start_exchange "
                    "passes it"
                )
            # Scaled in float32, then cast: a value beyond float16's range is brought in before the cast, a tiny one
            # is brought up before the cast would flush it. Scaling by a power of two is exact.
            scaled = workspace("cast.scaled", tensor.numel(), torch.float32, tensor.device).view_as(tensor)
            if tensor.dtype == torch.float32:
                torch.mul(tensor, scale, out=scaled)
            else:
                scaled.copy_(tensor).mul_(scale)
            return scaled.to(self.dtype), (tensor.dtype, scale)
        scale = self.scale_for(key)
        if scale != 1.0:
            return (tensor * scale).to(self.dtype), (tensor.dtype, scale)
        # A copy even when the buffer already has this dtype (a float16 model): never the buffer itself.
        return tensor.to(self.dtype, copy=True), (tensor.dtype, scale)

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        dtype, scale = ctx
        if _is_one(scale):
            return payload.to(dtype)
        # Never in place on the payload: a buffer of the payload's dtype (a float16 model's) is cast to itself, and
        # error feedback decodes the payload before it is sent.
        return payload.to(dtype).div_(scale) if payload.dtype != dtype else payload / scale

    # A full-size decoded temporary is spared: on the CPU each fresh one of more than a few MiB is new memory from the
    # kernel, whose page faults cost several times the cast itself.
    def decompress_into(self, payload: torch.Tensor, ctx: Any, out: torch.Tensor) -> torch.Tensor:
        """`decompress(payload, ctx)` written into `out` (of its shape and dtype)."""
        _, scale = ctx
        out.copy_(payload)
        return out if _is_one(scale) else out.div_(scale)


def _is_one(scale: float | torch.Tensor) -> bool:
    """Whether a scale is the number 1 (a tensor scale, on the device, is never looked at: no host read)."""
    return not isinstance(scale, torch.Tensor) and scale == 1.0


class TopK:
    """Send the `ratio` largest-magnitude elements as (values, int32 indices) in one float32 payload."""

    name, summable, lossy = "topk", False, True
    # A non-finite element is always sent (NaN and Inf are the largest magnitudes), but the residual holds most of the
    # gradient: a step whose sum is not finite (discarded by a GradScaler) must clear it on every rank, which needs
    # the host's decision (the exact retry), or the discarded step would reach later ones.
    keeps_finiteness = False

    def __init__(self, ratio: float, seed: int = 0, adaptive: AdaptiveRatio | None = None):
        self.ratio, self.adaptive = ratio, adaptive
        self._sampler = torch.Generator().manual_seed(seed)

    def compress(self, tensor: torch.Tensor, key: Any = None) -> tuple[torch.Tensor, Any]:
        n = tensor.numel()
        k = max(1, math.ceil(n * (self.adaptive.ratio(key) if self.adaptive is not None else self.ratio)))
        indices = self._top_indices(tensor.abs(), k)
        values = tensor[indices].to(torch.float32)
        payload = torch.cat([values, indices.to(torch.int32).view(torch.float32)])
        return payload, (n, tensor.dtype)

    @staticmethod
    def _unpack(payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, int64 indices) of a payload."""
        k = payload.numel() // 2
        return payload[:k], payload[k:].view(torch.int32).long()

    @staticmethod
    def values(payload: torch.Tensor) -> torch.Tensor:
        """The values of a payload (its second half holds indices)."""
        return payload[: payload.numel() // 2]

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        n, dtype = ctx
        values, indices = self._unpack(payload)
        out = torch.zeros(n, dtype=dtype, device=payload.device)
        out[indices] = values.to(dtype)
        return out

    def zero_sent(self, tensor: torch.Tensor, payload: torch.Tensor, ctx: Any) -> None:
        """Zero the elements of `tensor` this payload carries (cheaper than subtracting a dense decode)."""
        # index_fill_, not `tensor[indices] = 0`: that copies the 0 from the host, a sync on a GPU
        tensor.index_fill_(0, self._unpack(payload)[1], 0.0)

    def accumulate(self, payload: torch.Tensor, ctx: Any, out: torch.Tensor) -> None:
        """Add the decoded payload into `out`."""
        values, indices = self._unpack(payload)
        out.index_add_(0, indices, values.to(out.dtype))

    def payload_bytes(self, n: int) -> int:
        """The bytes of one payload for `n` elements (at the starting ratio)."""
        return 8 * max(1, math.ceil(n * self.ratio))

    def _top_indices(self, magnitude: torch.Tensor, k: int) -> torch.Tensor:
        n = magnitude.numel()
        # On a GPU torch's top-k is fast, and the sampled threshold below would stop the host on
        # every bucket (`.item()`, `nonzero()`): it is a CPU shortcut only.
        if k * 8 > n or n < 65536 or magnitude.device.type != "cpu":
            return magnitude.topk(k, sorted=False).indices
        # A full top-k over millions of elements is slow on CPU. Estimate a threshold from a
        # sample that lets through about 2k candidates, then take the exact top-k of those.
        sample = magnitude[torch.randint(n, (min(n, 32768),), generator=self._sampler).to(magnitude.device)]
        threshold = sample.float().quantile(1.0 - 2.0 * k / n).item()
        candidates = (magnitude >= threshold).nonzero().squeeze(1)
        if candidates.numel() < k:
            return magnitude.topk(k, sorted=False).indices
        return candidates[magnitude[candidates].topk(k, sorted=False).indices]


class RandomK:
    """Send k = ceil(ratio * n) elements of each buffer, chosen by a seed all workers share.

    Every worker picks the same elements, so payloads can be summed by allreduce (gossip-style
    downsampling). Each buffer (by `key`) walks its own random permutation of its n positions,
    k at a time: every element is sent once per round of ceil(n / k) calls (the last call of a
    round may send fewer), so a residual never waits longer than two rounds. The permutation is
    affine, i -> (a*i + b) mod n with a coprime to n, drawn afresh each round. Workers must call
    `compress` for a key in the same order, as they do for DDP buckets. The payload ends with one
    flag element, NaN when the buffer held a non-finite value anywhere, so that no worker's
    NaN or Inf can hide in a residual while the sum looks finite.
    """

    name, summable, lossy = "randomk", True, True
    keeps_finiteness = False  # only the payload's flag element tells of a non-finite element not sent

    def __init__(self, ratio: float, seed: int = 0, adaptive: AdaptiveRatio | None = None):
        self.ratio, self.seed, self.adaptive = ratio, seed, adaptive
        self.rounds: dict[Any, list[int]] = {}  # per key: [n, a, b, position in the round, rounds drawn]

    def _positions(self, n: int, key: Any, device: torch.device | None = None) -> torch.Tensor:
        k = max(1, math.ceil(n * (self.adaptive.ratio(key) if self.adaptive is not None else self.ratio)))
        state = self.rounds.get(key)
        if state is None or state[0] != n or state[3] >= n:
            drawn = state[4] if state is not None and state[0] == n else 0
            # The same draw on every rank; a function of (seed, key, round) only, so plain ints resume it.
            draw = random.Random(f"{self.seed}/{key!r}/{drawn}")
            a = draw.randrange(1, n) if n > 1 else 1
            while math.gcd(a, n) != 1:
                a = draw.randrange(1, n)
            state = self.rounds[key] = [n, a, draw.randrange(n), 0, drawn + 1]
        _, a, b, start, _ = state
        stop = min(start + k, n)
        state[3] = stop
        # Built where they are used: integer arithmetic, the same on every device (n * n < 2**63), and nothing
        # copied from pageable host memory on every call. The draw of a and b stays on the host, as it was.
        return (torch.arange(start, stop, dtype=torch.int64, device=device) * a + b) % n

    def compress(self, tensor: torch.Tensor, key: Any = None) -> tuple[torch.Tensor, Any]:
        index = self._positions(tensor.numel(), key, tensor.device)
        payload = tensor.new_empty(index.numel() + 1)
        torch.index_select(tensor, 0, index, out=payload[:-1])
        # 0 when every element is finite, NaN otherwise (a float32 sum: float16 elements could add up to Inf).
        payload[-1] = tensor.sum(dtype=torch.float32) * 0
        return payload, (tensor.numel(), index)

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        n, index = ctx
        out = torch.zeros(n, dtype=payload.dtype, device=payload.device)
        out[index] = payload[:-1]
        return out

    def zero_sent(self, tensor: torch.Tensor, payload: torch.Tensor, ctx: Any) -> None:
        """Zero the elements of `tensor` this payload carries."""
        tensor.index_fill_(0, ctx[1], 0)

    def accumulate(self, payload: torch.Tensor, ctx: Any, out: torch.Tensor) -> None:
        """Add the decoded payload into `out`."""
        out.index_add_(0, ctx[1], payload[:-1])


class BlockQuantized:
    """Send each block of `BLOCK` elements as 8-bit integers (int8) or 4-bit floats (fp4, E2M1), times the block's
    float32 scale (its largest magnitude over the largest code); decoded payloads are gathered and summed.

    The payload is one uint8 tensor: the scales' bytes, then the codes (two per byte for fp4). Rounding is to the
    nearest code, so error feedback carries what it drops. On the CPU, encoding and decoding run `CHUNK` blocks at a
    time in `workspace` buffers: no full-size temporary, the same bits as whole-tensor operations.
    """

    # A non-finite input makes its block's scale, hence its decoded block, non-finite; finite scales decode finite.
    summable, lossy, keeps_finiteness = False, True, True
    BLOCK = 256
    # Blocks per chunk on the CPU: 1M values (float32 buffers of 4 MiB), large enough that the per-op overhead of a
    # chunk's ~30 passes stays small. A GPU takes the whole tensor at once: a chunk's passes are kernel launches there.
    CHUNK = 4096
    FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1's magnitudes
    # The midpoints between E2M1's magnitudes are multiples of 1/4: floor(4 |x|) picks the nearest code (`_nearest`
    # computes this table's values).
    _NEAREST = torch.tensor([sum(q >= e for e in (1, 3, 5, 7, 10, 14, 20)) for q in range(25)], dtype=torch.uint8)
    # Each byte's two values (low nibble first), signs included, as the int64 of their float32 bits: decoding is one
    # table lookup per byte.
    _SIGNED = torch.cat([FP4, -FP4])
    _PAIRS = torch.stack([_SIGNED[torch.arange(256) & 15], _SIGNED[torch.arange(256) >> 4]], dim=1)
    _PAIRS = _PAIRS.view(torch.int64)[:, 0]
    _TOPS = torch.tensor([127.0, 6.0])  # int8's and fp4's largest codes
    # Those tables on each device that used them: (_PAIRS, _TOPS), copied there once for every instance.
    _ON_DEVICE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def _tables(cls, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tables = cls._ON_DEVICE.get(device)
        if tables is None:  # two threads may both copy: either copy is right
            tables = cls._ON_DEVICE[device] = (cls._PAIRS.to(device), cls._TOPS.to(device))
        return tables

    def __init__(self, name: str):
        if name not in ("int8", "fp4"):
            raise ValueError(f"invalid block codec {name!r}; accepted: int8, fp4")
        self.name = name
        self.top = slice(0, 1) if name == "int8" else slice(1, 2)  # its largest code in _TOPS, as a 1-element view
        self.code_bytes = self.BLOCK if name == "int8" else self.BLOCK // 2  # per block

    def _chunks(self, blocks: int, device: torch.device) -> list[tuple[int, int]]:
        step = self.CHUNK if device.type == "cpu" else max(blocks, 1)
        return [(first, min(first + step, blocks)) for first in range(0, blocks, step)]

    def compress(self, tensor: torch.Tensor, key: Any = None) -> tuple[torch.Tensor, Any]:
        n, flat, device = tensor.numel(), tensor.reshape(-1), tensor.device
        blocks = -(-n // self.BLOCK)
        payload = torch.empty(blocks * (4 + self.code_bytes), dtype=torch.uint8, device=device)
        scales = payload[: 4 * blocks].view(torch.float32)
        codes = payload[4 * blocks :].view(blocks, self.code_bytes)
        top = self._tables(device)[1][self.top]
        for first, last in self._chunks(blocks, device):
            shape, values = (last - first, self.BLOCK), flat[first * self.BLOCK : last * self.BLOCK]
            x = workspace("block.x", shape[0] * self.BLOCK, torch.float32, device)
            x[: values.numel()].copy_(values)
            x[values.numel() :].zero_()  # the last block's padding
            x, spare = x.view(shape), workspace("block.spare", x.numel(), torch.float32, device).view(shape)
            # Divided by a tensor on x's device: CUDA turns a division by a Python number into a product with its
            # reciprocal, which rounds differently from the CPU's (and IEEE's) division.
            scale = torch.amax(torch.abs(x, out=spare), dim=1, out=scales[first:last]).div_(top)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: codes 0
            # A non-finite input makes its block's scale non-finite, which is what the finiteness check reads; its
            # codes must still be valid. Zeroing what is not finite after normalising changes nothing for finite input
            # (finite over a finite, positive scale stays finite) and asks the host nothing: no sync on a GPU.
            if self.name == "int8":
                x = torch.div(x, safe[:, None], out=spare).nan_to_num_(0.0, 0.0, 0.0)
                codes[first:last].view(torch.int8).copy_(x.round_().clamp_(-127, 127))
            else:
                # (not x * (4 / safe): a subnormal scale's reciprocal overflows)
                x = torch.div(x, safe[:, None], out=spare).mul_(4.0).nan_to_num_(0.0, 0.0, 0.0)
                self._fp4_codes(x.clamp_(-24.0, 24.0), codes[first:last])
        return payload, (n, tensor.dtype, blocks)

    def _fp4_codes(self, quarters: torch.Tensor, out: torch.Tensor) -> None:
        """Pack fp4 codes into `out` (two per byte, low nibble first) for float32 `quarters` (4 x / scale, within
        +-24; used up): the sign bit where x < 0, and `_nearest`'s magnitude of floor(4 |x|).

        The passes are the ones a CPU runs fast: a float comparison, a float to uint8 conversion or a strided pack
        each cost several uint8 passes.
        """
        shape, device = quarters.shape, quarters.device
        # The sign bit of float32 is that of x < 0 once -0.0 (not below 0) is made +0.0, as adding +0.0 does.
        bits = workspace("fp4.bits", quarters.numel(), torch.int32, device).view(shape)
        torch.bitwise_right_shift(quarters.add_(0.0).view(torch.int32), 31, out=bits)  # -1 or 0
        sign = workspace("fp4.sign", quarters.numel(), torch.uint8, device).view(shape)
        sign.copy_(bits).bitwise_and_(8)  # -1 narrows to 255
        code = workspace("fp4.code", quarters.numel(), torch.uint8, device).view(shape)
        # Converted to int8 the values are truncated toward zero: floor(4 |x|) once their sign is dropped.
        magnitude = workspace("fp4.magnitude", quarters.numel(), torch.int8, device).view(shape)
        magnitude.copy_(quarters).abs_()
        term = workspace("fp4.term", quarters.numel(), torch.uint8, device).view(shape)
        code = self._nearest(magnitude.view(torch.uint8), code, term).bitwise_or_(sign)
        if _LITTLE_ENDIAN:
            # Each pair of codes as one int16 (the first in its low byte): shifted by 4 and or-ed with itself, its low
            # byte is the pair packed, which narrowing to uint8 keeps.
            pairs, packed = code.view(torch.int16), term.view(torch.int16)
            out.copy_(torch.bitwise_right_shift(pairs, 4, out=packed).bitwise_or_(pairs))
        else:
            torch.add(code[:, 0::2], code[:, 1::2], alpha=16, out=out)

    @staticmethod
    def _nearest(
        quarters: torch.Tensor, code: torch.Tensor | None = None, term: torch.Tensor | None = None
    ) -> torch.Tensor:
        """E2M1's nearest magnitude code for each uint8 `quarters` (floor(4 |x|), at most 24): `_NEAREST`'s values,
        written into `code` when given (`term`: a buffer of the same size).

        Sums of `(q >= t)` for the midpoints t, each as `(q + 128 - t) >> 7`: uint8 arithmetic, where a table lookup
        (int64 indices) or a comparison costs a CPU several times more.
        """
        # The midpoints 1, 3, 5, 7: half of q + 1, rounded down.
        code = torch.add(quarters, 1, out=code).bitwise_right_shift_(1).clamp_(max=4)
        for midpoint in (10, 14, 20):
            code += torch.add(quarters, 128 - midpoint, out=term).bitwise_right_shift_(7)
        return code

    def payload_bytes(self, n: int) -> int:
        """The bytes of one payload for `n` elements: a float32 scale and the codes of each block."""
        return -(-n // self.BLOCK) * (4 + self.code_bytes)

    def values(self, payload: torch.Tensor) -> torch.Tensor:
        """The scales (the finiteness check: a non-finite input makes its block's scale non-finite)."""
        return payload[: 4 * self._blocks(payload)].view(torch.float32)

    def _blocks(self, payload: torch.Tensor) -> int:
        return payload.numel() // (4 + self.code_bytes)

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        n, dtype, _ = ctx
        return self.decompress_into(payload, ctx, torch.empty(n, dtype=dtype, device=payload.device))

    def decompress_into(self, payload: torch.Tensor, ctx: Any, out: torch.Tensor) -> torch.Tensor:
        """`decompress(payload, ctx)` written into `out` (contiguous, of its size and dtype)."""
        self._decode(payload, ctx[2], out.view(-1), add=False)
        return out

    def accumulate(self, payload: torch.Tensor, ctx: Any, out: torch.Tensor) -> None:
        """Add the decoded payload into `out` (contiguous, of its size and dtype): `out += decompress(payload, ctx)`'s
        bits."""
        self._decode(payload, ctx[2], out.view(-1), add=True)

    def _decode(self, payload: torch.Tensor, blocks: int, flat: torch.Tensor, add: bool) -> None:
        scales = payload[: 4 * blocks].view(torch.float32)
        codes = payload[4 * blocks :].view(blocks, self.code_bytes)
        device = payload.device
        for first, last in self._chunks(blocks, device):
            count, target = last - first, flat[first * self.BLOCK : last * self.BLOCK]
            # In float32, then rounded once to the output's dtype (as decompress's `.to(dtype)`); straight into the
            # output where nothing is left to do after the product.
            direct = not add and flat.dtype == torch.float32 and target.numel() == count * self.BLOCK
            direct = direct and target.storage_offset() % 2 == 0  # viewed as int64 below
            x = target if direct else workspace("block.decoded", count * self.BLOCK, torch.float32, device)
            if self.name == "int8":
                x.view(count, self.BLOCK).copy_(codes[first:last].view(torch.int8))
            else:
                # Each byte's two float32 values as one int64: a gather of one 8-byte word per byte, several times
                # faster on a CPU than of a row of two floats.
                index = workspace("block.index", count * self.code_bytes, torch.int64, device)
                index.copy_(codes[first:last].reshape(-1))
                torch.index_select(self._tables(device)[0], 0, index, out=x.view(torch.int64))
            x.view(count, self.BLOCK).mul_(scales[first:last, None])
            if direct:
                continue
            values = x[: target.numel()]
            if not add:
                target.copy_(values)
            else:
                target.add_(values if flat.dtype == torch.float32 else values.to(flat.dtype))


def workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of `numel` elements: on the CPU this thread's `name` buffer, kept for its next call (a fresh large
    CPU tensor is new memory from the kernel, whose page faults cost more than a pass over it); elsewhere a fresh
    tensor (a GPU's caching allocator already reuses its blocks, in its stream's order)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    buffers = getattr(_WORKSPACES, "buffers", None)
    if buffers is None:
        buffers = _WORKSPACES.buffers = _Buffers()
        with _LIVE_LOCK:
            _LIVE_WORKSPACES.add(buffers)
    buffer = buffers.by_key.get((name, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = buffers.by_key[(name, dtype)] = torch.empty(numel, dtype=dtype)
        if context.first_time("codec workspaces"):  # a bucket's size each: shutdown() gives the memory back
            context.on_undo("codec workspaces", release_workspaces)
    return buffer[:numel]


def release_workspaces() -> None:
    """Drop every thread's `workspace` buffers (a slice handed out before stays valid: it holds its memory)."""
    with _LIVE_LOCK:  # a thread making its first buffer meanwhile would change the set under the copy
        live = list(_LIVE_WORKSPACES)
    for buffers in live:
        buffers.by_key.clear()


class _Buffers:
    """One thread's `workspace` buffers, by (name, dtype)."""

    __slots__ = ("by_key", "__weakref__")  # by_key: the buffers; __weakref__: shutdown() finds the live threads'

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, torch.dtype], torch.Tensor] = {}


_WORKSPACES = threading.local()  # each thread's `workspace` buffers, freed with the thread
_LIVE_WORKSPACES: weakref.WeakSet[_Buffers] = weakref.WeakSet()  # those of the threads alive, for shutdown()
_LIVE_LOCK = threading.Lock()
_LITTLE_ENDIAN = sys.byteorder == "little"


CODECS = ("none", "fp16", "bf16", "topk", "randomk", "int8", "fp4")


def get_codec(
    name: str,
    *,
    ratio: float = 0.01,
    fp16_scale: float | str = 1.0,
    seed: int = 0,
    ratio_max: float | None = None,
    device: torch.device | None = None,
) -> Codec:
    """The codec for a `compression` value (`powersgd` is a hook of its own, not a codec).

    With `ratio_max` above `ratio`, topk's and randomk's ratio adapts between them (`AdaptiveRatio`).
    `fp16_scale="auto"` is `peak` where the sums run on an accelerator (`device`), `dynamic` on the CPU (None).
    """
    if fp16_scale == "auto":
        # dynamic's exact retry reads each sum on the host: free on the CPU, a stall of the device's queue
        # elsewhere. peak reads nothing, for one small collective more per sum (on the CPU it costs more than
        # the read: docs/results.md#which-per-step-codec-keeps-quality).
        fp16_scale = "peak" if device is not None and device.type != "cpu" else "dynamic"
    adaptive = AdaptiveRatio(ratio, ratio_max) if ratio_max is not None and name in ("topk", "randomk") else None
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return CastCompression("fp16", torch.float16, fp16_scale)
    if name == "bf16":
        return CastCompression("bf16", torch.bfloat16)
    if name == "topk":
        return TopK(ratio, seed, adaptive)
    if name == "randomk":
        return RandomK(ratio, seed, adaptive)
    if name in ("int8", "fp4"):
        return BlockQuantized(name)
    raise ValueError(f"invalid compression={name!r}; accepted: {', '.join(CODECS)}")


class ErrorFeedback:
    """Per-buffer residuals of a lossy codec (and momentum, for momentum correction).

    `corrected = g + residual` is what gets compressed; what the payload does not carry
    becomes the next residual. With momentum m: u = m*u + (1 - dampening)*g and residual += u
    (nesterov: residual += g + m*u), so that error feedback acts on momentum SGD's update
    (Deep Gradient Compression's momentum correction). With `masking`, u is also cleared where
    elements were sent (DGC's momentum factor masking).
    """

    def __init__(self, momentum: float = 0.0, *, nesterov: bool = False, dampening: float = 0.0, masking: bool = True):
        self.momentum, self.nesterov, self.dampening, self.masking = momentum, nesterov, dampening, masking
        self.residuals: dict[Any, torch.Tensor] = {}
        self.velocities: dict[Any, torch.Tensor] = {}

    def correct(
        self, key: Any, tensor: torch.Tensor, scale: float = 1.0, velocity: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The residual buffer for `key`, with `scale * tensor` added in (the input is not changed).

        `velocity` starts `key`'s momentum when it has none yet (an optimizer's momentum taken over).
        """
        residual = self.residuals.get(key)
        if residual is None or residual.shape != tensor.shape:  # DDP rebuilds its buckets once
            residual = self.residuals[key] = torch.zeros_like(tensor)
            self.velocities.pop(key, None)
        if self.momentum:
            u = self.velocities.get(key)
            if u is None or u.shape != tensor.shape:
                u = self.velocities[key] = (
                    torch.zeros_like(tensor) if velocity is None else velocity.to(tensor.dtype, copy=True)
                )
            u.mul_(self.momentum).add_(tensor, alpha=scale * (1.0 - self.dampening))
            if self.nesterov:
                return residual.add_(tensor, alpha=scale).add_(u, alpha=self.momentum)
            return residual.add_(u)
        return residual.add_(tensor, alpha=scale)

    def update(
        self, key: Any, corrected: torch.Tensor, codec: Codec, payload: torch.Tensor, ctx: Any
    ) -> torch.Tensor | None:
        """Keep in `corrected` (the buffer `correct` returned) what `payload` did not carry; returns `payload` decoded
        (None for a sparse codec, or a summed one's), which the sum of the gathered payloads can reuse."""
        mask = bool(self.momentum) and self.masking
        zero_sent = getattr(codec, "zero_sent", None)
        if zero_sent is not None:  # sparse codecs send some elements exactly and nothing of the rest
            zero_sent(corrected, payload, ctx)
            if mask:
                zero_sent(self.velocities[key], payload, ctx)
            return None
        decompress_into = getattr(codec, "decompress_into", None)
        summed = decompress_into is not None and codec.summable
        if summed:
            # A summed payload is decoded from the sum, never this rank's own: its decode goes to the thread's buffer.
            sent = workspace("feedback.sent", corrected.numel(), corrected.dtype, corrected.device)
            sent = decompress_into(payload, ctx, sent.view_as(corrected))
        else:
            sent = codec.decompress(payload, ctx)
        if mask:
            self.velocities[key].masked_fill_(sent != 0, 0.0)
        corrected.sub_(sent)
        if getattr(codec, "keeps_finiteness", False):
            # No host read decides whether this sum was finite (its non-finite sum is passed on, as plain DDP's),
            # so what a non-finite gradient left here is dropped on the device: it must not reach later steps.
            corrected.nan_to_num_(0.0, 0.0, 0.0)
            if self.momentum:
                self.velocities[key].nan_to_num_(0.0, 0.0, 0.0)
        return None if summed else sent

    def clear(self, key: Any) -> None:
        """Forget what `key`'s residual (and velocity) held: after an exact exchange, or a non-finite one."""
        for store in (self.residuals, self.velocities):
            if key in store:
                store[key].zero_()
