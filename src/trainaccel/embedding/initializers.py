"""Row initializers that depend only on (seed, key): a key's first value is the same on any rank or shard.

That makes sharded, resharded and single-process training start from identical rows.
An initializer is any callable `(keys: int64 [n], dim) -> float tensor [n, dim]`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from trainaccel.embedding.hashing import combine

Initializer = Callable[[torch.Tensor, int], torch.Tensor]

_BITS = 24  # float32 holds 24-bit integers exactly


def _uniform_bits(keys: torch.Tensor, dim: int, seed: int, stream: int) -> torch.Tensor:
    """Uniform floats in [0, 1) of shape [n, dim], a pure function of (seed, stream, key, column)."""
    columns = torch.arange(dim, dtype=torch.int64, device=keys.device)
    bits = combine(combine(keys.to(torch.int64), seed * 2 + stream).unsqueeze(1), columns)
    return ((bits >> (64 - _BITS)) & ((1 << _BITS) - 1)).to(torch.float32) / float(1 << _BITS)


def normal(std: float = 0.01, mean: float = 0.0, seed: int = 0) -> Initializer:
    """N(mean, std^2) per element (Box-Muller on key-hashed uniforms)."""

    def init(keys: torch.Tensor, dim: int) -> torch.Tensor:
        u1 = 1.0 - _uniform_bits(keys, dim, seed, 0)  # (0, 1]: log stays finite
        u2 = _uniform_bits(keys, dim, seed, 1)
        return mean + std * torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)

    return init


def uniform(low: float = -0.05, high: float = 0.05, seed: int = 0) -> Initializer:
    """U(low, high) per element."""
    if not low < high:
        raise ValueError(f"invalid uniform range low={low}, high={high}; accepted: low < high")

    def init(keys: torch.Tensor, dim: int) -> torch.Tensor:
        return low + (high - low) * _uniform_bits(keys, dim, seed, 0)

    return init


def constant(value: float = 0.0) -> Initializer:
    """Every element `value` (zeros by default)."""

    def init(keys: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.full((keys.numel(), dim), float(value), device=keys.device)

    return init


NAMED = {"normal": normal, "uniform": uniform, "zeros": constant}


def resolve(initializer: Initializer | str | float | None) -> Initializer:
    """An initializer from a callable, a name (normal, uniform, zeros), a constant, or None (normal)."""
    if initializer is None:
        return normal()
    if isinstance(initializer, str):
        if initializer not in NAMED:
            raise ValueError(
                f"invalid initializer {initializer!r}; accepted: {', '.join(NAMED)}, a number or a callable"
            )
        return NAMED[initializer]()
    if isinstance(initializer, (int, float)) and not isinstance(initializer, bool):
        return constant(initializer)
    if callable(initializer):
        return initializer
    raise ValueError(
        f"invalid initializer {initializer!r}; accepted: {', '.join(NAMED)}, a number or a callable (keys, dim) -> rows"
    )
