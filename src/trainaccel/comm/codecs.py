"""Gradient codecs: `compress(tensor) -> (payload, ctx)` and `decompress(payload, ctx) -> tensor`.

A codec sees a flat gradient buffer already divided by the world size; its payload is what
crosses the network and must be summable by allreduce.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Codec(Protocol):
    name: str

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class NoCompression:
    """Send the buffer as it is (lossless)."""

    name = "none"

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        return payload


class CastCompression:
    """Send the buffer in a narrower float dtype (fp16 or bf16), restore the original dtype after."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor.to(self.dtype), tensor.dtype

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        return payload.to(ctx)


def get_codec(name: str) -> Codec:
    """The codec for a `compression` option value."""
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return CastCompression("fp16", torch.float16)
    if name == "bf16":
        return CastCompression("bf16", torch.bfloat16)
    raise ValueError(f"invalid compression={name!r}; accepted: none, fp16, bf16")
