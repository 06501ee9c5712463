"""Horovod's `Compression.none` and `Compression.fp16`: `compress(t) -> (t, ctx)`, `decompress(t, ctx)`."""

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


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16; other dtypes are left alone."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """The compressors, as `hvd.Compression.none` and `hvd.Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
