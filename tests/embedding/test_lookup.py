"""embedding_lookup_sparse against nn.EmbeddingBag and an explicit per-bag loop, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainaccel.embedding import COMBINERS, DynamicEmbedding, SparseTensor, embedding_lookup_sparse

DIM = 5
LENGTHS = [3, 0, 1, 4, 0, 2, 5]  # bags 1 and 4 are empty


@pytest.fixture
def case():
    """Bags of int64 keys from a small vocabulary (repeats inside and across bags), weights, and a table."""
    g = torch.Generator().manual_seed(0)
    vocab = torch.tensor([-(2**63), 2**63 - 1, 0, -1, 123456789012345, 7, 42, -999])
    positions = torch.randint(0, vocab.numel(), (sum(LENGTHS),), generator=g)
    table = DynamicEmbedding(DIM, initializer="normal")
    table.rows_for(vocab)  # a row for every key up front
    table.take_gradients()
    return {
        "vocab": vocab,
        "positions": positions,
        "values": vocab[positions],
        "weights": torch.rand(sum(LENGTHS), generator=g, dtype=torch.float32) + 0.1,
        "offsets": torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0)[:-1].tolist()]),
        "table": table,
        "upstream": torch.randn(len(LENGTHS), DIM, generator=g),
    }


def _rows(table: DynamicEmbedding, keys: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return table.rows_for(keys).clone()


def _loop_reference(weight: torch.Tensor, positions, weights, combiner: str) -> torch.Tensor:
    """TensorFlow's definition, one bag at a time."""
    out, start = [], 0
    for length in LENGTHS:
        ids, w = positions[start : start + length], weights[start : start + length]
        start += length
        total = (w[:, None] * weight[ids]).sum(0)
        norm = {"sum": 1.0, "mean": w.sum(), "sqrtn": torch.sqrt((w * w).sum())}[combiner]
        out.append(total / norm if length else torch.zeros(weight.shape[1]))
    return torch.stack(out)


def _bag_reference(weight: torch.Tensor, case, weighted: bool, combiner: str) -> nn.EmbeddingBag:
    """nn.EmbeddingBag with the combiner's normalisation as per-sample weights (or its own mean mode)."""
    w = case["weights"] if weighted else torch.ones_like(case["weights"])
    bag = nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode="sum")
    if combiner == "mean" and not weighted:
        bag.mode = "mean"
        return bag(case["positions"], case["offsets"]), bag
    scale, start = [], 0
    for length in LENGTHS:
        piece = w[start : start + length]
        start += length
        norm = {"sum": torch.ones(()), "mean": piece.sum(), "sqrtn": torch.sqrt((piece * piece).sum())}[combiner]
        scale.append(piece / norm)
    return bag(case["positions"], case["offsets"], per_sample_weights=torch.cat(scale)), bag


def _layouts(case):
    values, offsets, weights = case["values"], case["offsets"], case["weights"]
    bag = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    position = torch.cat([torch.arange(n) for n in LENGTHS])
    shuffle = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(1))  # unsorted indices
    indices = torch.stack([bag, position], 1)[shuffle]
    shape = (len(LENGTHS), max(LENGTHS))
    yield "offsets", dict(ids=values, offsets=offsets), weights
    yield (
        "SparseTensor",
        dict(ids=SparseTensor(indices, values[shuffle], shape)),
        SparseTensor(indices, weights[shuffle], shape),
    )
    coo = torch.sparse_coo_tensor(indices.T, values[shuffle], shape, check_invariants=True)
    yield (
        "torch sparse",
        dict(ids=coo),
        torch.sparse_coo_tensor(indices.T, weights[shuffle], shape, check_invariants=True),
    )


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_dynamic_lookup_equals_embedding_bag_forward_and_backward(case, combiner, weighted):
    table, vocab = case["table"], case["vocab"]
    weight = _rows(table, vocab)
    expected, reference = _bag_reference(weight, case, weighted, combiner)
    (expected * case["upstream"]).sum().backward()
    loop = _loop_reference(
        weight, case["positions"], case["weights"] if weighted else torch.ones_like(case["weights"]), combiner
    )
    torch.testing.assert_close(expected, loop, rtol=1e-6, atol=1e-7)
    assert torch.equal(expected[1], torch.zeros(DIM)) and torch.equal(expected[4], torch.zeros(DIM))

    for layout, kwargs, weights in _layouts(case):
        out = embedding_lookup_sparse(table, weights=weights if weighted else None, combiner=combiner, **kwargs)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7, msg=f"{layout}: forward")
        (out * case["upstream"]).sum().backward()
        rows, grad = table.take_gradients()
        by_row = dict(zip(table._find_rows(vocab).tolist(), range(vocab.numel())))
        got = torch.zeros_like(weight)
        got[[by_row[r] for r in rows.tolist()]] = grad
        torch.testing.assert_close(got, reference.weight.grad, rtol=1e-6, atol=1e-7, msg=f"{layout}: gradient")


def test_plain_tables_take_the_same_path(case):
    weight = torch.randn(8, DIM)
    expected = nn.EmbeddingBag.from_pretrained(weight, mode="mean")(case["positions"], case["offsets"])
    for table in (weight, nn.Embedding.from_pretrained(weight)):
        out = embedding_lookup_sparse(table, case["positions"], combiner="mean", offsets=case["offsets"])
        torch.testing.assert_close(out, expected)
    dense = torch.tensor([[1, 2], [3, 3]])
    torch.testing.assert_close(embedding_lookup_sparse(weight, dense), weight[[1, 3]] + weight[[2, 3]])


def test_all_empty_bags_give_zeros(case):
    out = embedding_lookup_sparse(
        case["table"], torch.empty(0, dtype=torch.int64), offsets=torch.zeros(3, dtype=torch.int64)
    )
    assert torch.equal(out, torch.zeros(3, DIM))


def test_sqrtn_scales_by_the_root_of_the_squared_weights():
    weight = torch.eye(3)
    out = embedding_lookup_sparse(weight, torch.tensor([[0, 1]]), weights=torch.tensor([[3.0, 4.0]]), combiner="sqrtn")
    torch.testing.assert_close(out, torch.tensor([[3 / 5, 4 / 5, 0.0]]))
    assert math.isclose(float(out.norm()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(combiner="max"), ValueError, "invalid combiner 'max'; accepted: sum, mean, sqrtn"),
        (dict(ids=torch.tensor([1.0, 2.0]), offsets=torch.tensor([0])), TypeError, "ids dtype torch.float32"),
        (dict(offsets=torch.tensor([0, 2, 1])), ValueError, r"offsets\[2\]=1 < offsets\[1\]=2"),
        (dict(offsets=torch.tensor([1, 2])), ValueError, "the first is 1"),
        (dict(offsets=torch.tensor([0, 9])), ValueError, "the last is 9 but there are 3 ids"),
        (dict(weights=torch.ones(2)), ValueError, "2 values for 3 ids"),
        (dict(ids=torch.tensor([1, 2, 3]), offsets=None), ValueError, "without offsets"),
        (
            dict(ids=SparseTensor(torch.tensor([[0, 0], [5, 0]]), torch.tensor([1, 2]), (2, 1)), offsets=None),
            ValueError,
            "outside",
        ),
    ],
)
def test_bad_input_is_named(kwargs, error, match):
    args = dict(ids=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 1]), combiner="sum") | kwargs
    with pytest.raises(error, match=match):
        embedding_lookup_sparse(torch.zeros(4, 2), **args)


def test_plain_table_ids_out_of_range_are_named():
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        embedding_lookup_sparse(torch.zeros(4, 2), torch.tensor([[0, 4]]))
