"""Horovod's compressors (`compress(t) -> (t, ctx)`, `decompress(t, ctx)`) and trainaccel's extra codecs.

`none`, `fp16` and `bf16` change the dtype on the wire and work everywhere. `topk(ratio)` and
`randomk(ratio)` send a fraction of each gradient bucket with error feedback (what is not sent
is kept and added to the next step's gradient); they need state across steps, so only
`DistributedOptimizer` takes them.
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Horovod's compressor interface (static methods)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Floating-point tensors travel as `wire_dtype`; other dtypes are left alone."""

    wire_dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.type(cls.wire_dtype), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class FP16Compressor(_CastCompressor):
    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """bfloat16 has float32's range, so large gradients do not overflow as in float16."""

    wire_dtype = torch.bfloat16


class CodecCompression:
    """A sparsifying trainaccel codec with per-bucket error feedback, for `DistributedOptimizer`."""

    def __init__(self, name: str, ratio: float, momentum: float = 0.0):
        from trainaccel.comm.codecs import ErrorFeedback, get_codec

        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1:
            raise ValueError(f"invalid ratio={ratio!r}; accepted: a number in (0, 1]")
        if not isinstance(momentum, (int, float)) or not 0 <= momentum <= 1:
            raise ValueError(f"invalid momentum={momentum!r}; accepted: a number in [0, 1]")
        self.name, self.ratio = name, float(ratio)
        self.codec = get_codec(name, ratio=self.ratio)
        self.feedback = ErrorFeedback(momentum)

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise ValueError(
            f"Compression.{self.name} keeps error feedback across steps; pass it to DistributedOptimizer, "
            "and use none, fp16 or bf16 with allreduce"
        )

    decompress = compress

    def __repr__(self) -> str:
        return f"Compression.{self.name}(ratio={self.ratio})"


class Compression:
    """The compressors: Horovod's `none` and `fp16`, and trainaccel's `bf16`, `topk(ratio)`, `randomk(ratio)`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def topk(ratio: float = 0.01, momentum: float = 0.0) -> CodecCompression:
        """Send the largest `ratio` of each bucket's elements (exact top-k), with error feedback."""
        return CodecCompression("topk", ratio, momentum)

    @staticmethod
    def randomk(ratio: float = 0.01, momentum: float = 0.0) -> CodecCompression:
        """Send a random `ratio` of each bucket's elements, the same ones on every worker, with error feedback."""
        return CodecCompression("randomk", ratio, momentum)
