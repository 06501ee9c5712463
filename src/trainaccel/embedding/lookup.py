"""`embedding_lookup_sparse`: pooled lookups over ragged ids with TensorFlow's combiners.

Ids come as a `SparseTensor(indices [N, 2], values [N], dense_shape)` (TensorFlow's layout), a torch
sparse COO tensor, flat values with `offsets` (torch.nn.EmbeddingBag's layout), or a dense [B, L]
tensor. Row b of the result combines the embeddings of bag b; a bag with no ids gives zeros.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from trainaccel.embedding.dynamic import check_keys

COMBINERS = ("sum", "mean", "sqrtn")


class SparseTensor(NamedTuple):
    """TensorFlow's sparse layout: `indices` [N, 2] as (bag, position), `values` [N], `dense_shape` (B, L)."""

    indices: torch.Tensor
    values: torch.Tensor
    dense_shape: tuple[int, ...] | torch.Tensor


Ids = Union[torch.Tensor, SparseTensor]


class Bags(NamedTuple):
    """Ids flattened bag after bag: `values` [N], bag starts `offsets` [B], per-id `weights` [N] or None."""

    values: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    num_bags: int


def _check_offsets(offsets: torch.Tensor, n: int) -> torch.Tensor:
    offsets = check_keys(offsets, "offsets")
    if offsets.dim() != 1:
        raise ValueError(f"invalid offsets of shape {tuple(offsets.shape)}; accepted: a 1-D tensor of bag starts")
    if offsets.numel():
        if int(offsets[0]) != 0:
            raise ValueError(f"invalid offsets: the first is {int(offsets[0])}; accepted: bag starts beginning at 0")
        steps = offsets[1:] - offsets[:-1]
        if (steps < 0).any():
            at = int(torch.nonzero(steps < 0)[0]) + 1
            raise ValueError(
                f"invalid offsets: offsets[{at}]={int(offsets[at])} < offsets[{at - 1}]={int(offsets[at - 1])}; "
                "accepted: non-decreasing bag starts"
            )
        if int(offsets[-1]) > n:
            raise ValueError(f"invalid offsets: the last is {int(offsets[-1])} but there are {n} ids")
    return offsets


def _weights_like(weights: Ids | None, values: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor | None:
    if weights is None:
        return None
    if isinstance(weights, SparseTensor):
        weights = weights.values
    elif isinstance(weights, torch.Tensor) and weights.is_sparse:
        weights = weights._values()
    if not isinstance(weights, torch.Tensor) or not weights.dtype.is_floating_point:
        raise TypeError(
            f"invalid weights {type(weights).__name__}; accepted: floating-point values shaped like the ids"
        )
    weights = weights.reshape(-1)
    if weights.numel() != values.numel():
        raise ValueError(
            f"invalid weights: {weights.numel()} values for {values.numel()} ids; accepted: one weight per id"
        )
    return weights if order is None else weights[order]


def to_bags(ids: Ids, weights: Ids | None = None, offsets: torch.Tensor | None = None) -> Bags:
    """Any accepted ids layout -> `Bags` (values grouped by bag)."""
    if isinstance(ids, SparseTensor) or (isinstance(ids, torch.Tensor) and ids.is_sparse):
        if offsets is not None:
            raise ValueError("offsets are given by the sparse ids' indices; pass one or the other")
        if isinstance(ids, SparseTensor):
            indices, values, shape = ids.indices, ids.values, tuple(int(d) for d in ids.dense_shape)
            if indices.dim() != 2 or indices.shape[1] != 2:
                raise ValueError(f"invalid SparseTensor indices of shape {tuple(indices.shape)}; accepted: [N, 2]")
            bag = indices[:, 0]
        else:
            if ids.sparse_dim() != 2:
                raise ValueError(f"invalid sparse ids with {ids.sparse_dim()} sparse dims; accepted: 2 (bag, position)")
            indices, values, shape = ids._indices(), ids._values(), tuple(ids.shape)
            bag = indices[0]
        values = check_keys(values)
        if values.numel() != bag.numel():
            raise ValueError(f"invalid sparse ids: {bag.numel()} indices for {values.numel()} values")
        num_bags = shape[0]
        if bag.numel() and (int(bag.min()) < 0 or int(bag.max()) >= num_bags):
            raise ValueError(f"invalid sparse ids: a bag index outside [0, {num_bags}) of dense_shape {shape}")
        order = None
        if bag.numel() > 1 and bool((bag[1:] < bag[:-1]).any()):
            order = torch.argsort(bag, stable=True)
            bag, values = bag[order], values[order]
        starts = torch.searchsorted(bag.contiguous(), torch.arange(num_bags, device=bag.device))
        return Bags(values, starts, _weights_like(weights, values, order), num_bags)
    values = check_keys(ids)
    if offsets is None:
        if values.dim() != 2:
            raise ValueError(
                f"invalid ids of shape {tuple(values.shape)} without offsets; accepted: [B, L] bags, "
                "1-D ids with offsets, a SparseTensor or a torch sparse tensor"
            )
        num_bags, length = values.shape
        offsets = torch.arange(0, num_bags * length, length, device=values.device)
        return Bags(values.reshape(-1), offsets, _weights_like(weights, values), num_bags)
    if values.dim() != 1:
        raise ValueError(f"invalid ids of shape {tuple(values.shape)} with offsets; accepted: 1-D ids")
    offsets = _check_offsets(offsets.to(values.device), values.numel())
    return Bags(values, offsets, _weights_like(weights, values), offsets.numel())


def check_combiner(combiner: str) -> None:
    if combiner not in COMBINERS:
        raise ValueError(f"invalid combiner {combiner!r}; accepted: {', '.join(COMBINERS)}")


def _bag_index(bags: Bags) -> torch.Tensor:
    """The bag of each id."""
    n = bags.values.numel()
    marks = torch.zeros(n + 1, dtype=torch.int64, device=bags.values.device)
    marks.index_add_(0, bags.offsets, torch.ones_like(bags.offsets))
    return torch.cumsum(marks[:n], 0) - 1


def combiner_weights(bags: Bags, combiner: str, dtype: torch.dtype) -> torch.Tensor | None:
    """Per-id weights that turn a weighted sum into `combiner` (mean: w/sum w, sqrtn: w/sqrt(sum w^2))."""
    check_combiner(combiner)
    w = bags.weights
    if combiner == "sum":
        return None if w is None else w.to(dtype)
    if w is None:
        w = torch.ones(bags.values.numel(), dtype=dtype, device=bags.values.device)
    w = w.to(dtype)
    bag = _bag_index(bags)
    total = torch.zeros(bags.num_bags, dtype=dtype, device=w.device).index_add(
        0, bag, w if combiner == "mean" else w * w
    )
    norm = total if combiner == "mean" else torch.sqrt(total)
    norm = norm[bag]
    return torch.where(norm != 0, w / torch.where(norm != 0, norm, torch.ones_like(norm)), torch.zeros_like(w))


def embedding_lookup_sparse(
    table: nn.Module | torch.Tensor,
    ids: Ids,
    weights: Ids | None = None,
    combiner: str = "sum",
    *,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pooled embeddings [B, dim] of bags of ids from a DynamicEmbedding, sharded table, nn.Embedding or weight."""
    check_combiner(combiner)  # before any lookup changes a table
    bags = to_bags(ids, weights, offsets)
    if hasattr(table, "rows_for"):
        unique, inverse, counts = torch.unique(bags.values, return_inverse=True, return_counts=True)
        rows, index = table.rows_for(unique, counts), inverse
    else:
        rows = table.weight if isinstance(table, (nn.Embedding, nn.EmbeddingBag)) else table
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
            raise TypeError(
                f"invalid table {type(table).__name__}; accepted: DynamicEmbedding, a sharded table, "
                "nn.Embedding, nn.EmbeddingBag or a 2-D weight tensor"
            )
        index = bags.values
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows.shape[0]):
            raise ValueError(f"invalid ids: outside [0, {rows.shape[0]}) for a table of {rows.shape[0]} rows")
    return pool(bags, rows, index, combiner)


def pool(bags: Bags, rows: torch.Tensor, index: torch.Tensor, combiner: str) -> torch.Tensor:
    """[B, dim]: bag b combines rows[index[i]] over its ids i; an empty bag gives zeros."""
    scale = combiner_weights(bags, combiner, rows.dtype)
    if bags.values.numel() == 0:
        return rows.new_zeros(bags.num_bags, rows.shape[1])
    return F.embedding_bag(index, rows, bags.offsets, mode="sum", per_sample_weights=scale)
