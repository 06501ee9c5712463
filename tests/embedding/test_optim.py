"""Sparse optimizers against their dense torch.optim counterparts over several steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainaccel.embedding import (
    DynamicEmbedding,
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
    embedding_lookup_sparse,
)

DIM, KEYS, STEPS = 4, 12, 6
UNTOUCHED = [10, 11]  # never looked up


def _batches(every_row: bool = False):
    """Per step: bags over key positions 0..9, a different subset each step (some rows skip steps)."""
    g = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        if every_row:
            ids = torch.arange(10).repeat(2)[torch.randperm(20, generator=g)].reshape(5, 4)
        else:
            ids = torch.randint(0, 10 if step % 2 else 5, (5, 4), generator=g)
        yield ids, torch.rand(5, 4, generator=g), torch.randn(5, DIM, generator=g)


def _train_dynamic(optimizer_cls, keys, every_row=False, **hp):
    table = DynamicEmbedding(DIM, initializer="normal")
    optimizer = optimizer_cls(table, **hp)
    table.rows_for(keys)  # rows exist for all keys, untouched ones included
    table.take_gradients()
    initial = table.rows_for(keys).detach().clone()
    table.take_gradients()
    for ids, weights, upstream in _batches(every_row):
        out = embedding_lookup_sparse(table, keys[ids], weights, combiner="mean")
        optimizer.zero_grad()
        (out * upstream).sum().backward()
        optimizer.step()
    table.eval()
    return table, initial


def _train_dense(optimizer_fn, initial, every_row=False, sparse=False):
    emb = nn.Embedding.from_pretrained(initial.clone(), freeze=False, sparse=sparse)
    optimizer = optimizer_fn(emb.parameters())
    for ids, weights, upstream in _batches(every_row):
        out = (emb(ids) * (weights / weights.sum(1, keepdim=True))[..., None]).sum(1)
        optimizer.zero_grad()
        (out * upstream).sum().backward()
        optimizer.step()
    return emb.weight.detach(), optimizer


KEYS_T = torch.tensor([2**40 + 7 * i for i in range(KEYS)])


@pytest.mark.parametrize(
    "ours, theirs, hp",
    [
        (SparseSGD, torch.optim.SGD, dict(lr=0.3)),
        (SparseAdagrad, torch.optim.Adagrad, dict(lr=0.3, eps=1e-10, initial_accumulator_value=0.1)),
    ],
    ids=["sgd", "adagrad"],
)
def test_matches_the_dense_optimizer_and_leaves_untouched_rows(ours, theirs, hp):
    table, initial = _train_dynamic(ours, KEYS_T, **hp)
    expected, dense_opt = _train_dense(lambda p: theirs(p, **hp), initial)
    got = table(KEYS_T)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(got[:10], initial[:10])
    assert torch.equal(got[UNTOUCHED], initial[UNTOUCHED])
    if ours is SparseAdagrad:
        state = table.row_state["sum"][table._find_rows(KEYS_T)]
        torch.testing.assert_close(
            state, dense_opt.state[dense_opt.param_groups[0]["params"][0]]["sum"], rtol=1e-6, atol=1e-7
        )
        assert torch.equal(state[UNTOUCHED], torch.full((2, DIM), 0.1))


def test_adam_matches_torch_adam_when_every_row_is_touched():
    table, initial = _train_dynamic(SparseAdam, KEYS_T, every_row=True, lr=0.05)
    expected, _ = _train_dense(lambda p: torch.optim.Adam(p, lr=0.05), initial, every_row=True)
    got = table(KEYS_T)
    torch.testing.assert_close(got[:10], expected[:10], rtol=1e-5, atol=1e-7)
    assert torch.equal(got[UNTOUCHED], initial[UNTOUCHED])  # dense Adam never saw a gradient for them either


def test_adam_is_lazy_like_torch_sparse_adam():
    """Rows skipping a step keep their moments. SparseAdam adds eps before the bias correction, Adam after: a tiny eps."""
    table, initial = _train_dynamic(SparseAdam, KEYS_T, lr=0.05, eps=1e-12)
    expected, _ = _train_dense(lambda p: torch.optim.SparseAdam(list(p), lr=0.05, eps=1e-12), initial, sparse=True)
    got = table(KEYS_T)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[UNTOUCHED], initial[UNTOUCHED])
    state = table.row_state["exp_avg"][table._find_rows(KEYS_T)]
    assert torch.equal(state[UNTOUCHED], torch.zeros(2, DIM)) and state[:5].abs().sum() > 0


def test_rowwise_adagrad_matches_its_formula():
    """No torch.optim counterpart: compared with the formula written out densely."""
    table, initial = _train_dynamic(RowWiseAdagrad, KEYS_T, lr=0.3)
    weight, acc = initial.clone().requires_grad_(True), torch.zeros(KEYS, 1)
    for ids, weights, upstream in _batches():
        out = (weight[ids] * (weights / weights.sum(1, keepdim=True))[..., None]).sum(1)
        (grad,) = torch.autograd.grad((out * upstream).sum(), weight)
        touched = grad.abs().sum(1) > 0
        with torch.no_grad():
            acc[touched] += grad[touched].pow(2).mean(1, keepdim=True)
            weight[touched] -= 0.3 * grad[touched] / (acc[touched].sqrt() + 1e-10)
    torch.testing.assert_close(table(KEYS_T), weight.detach(), rtol=1e-6, atol=1e-7)
    assert table.row_state["row_sum"].shape[1] == 1


def test_state_is_reset_when_an_evicted_row_is_reused():
    table = DynamicEmbedding(2, capacity=1, initializer="zeros")
    optimizer = SparseAdagrad(table, lr=0.1)
    for key in (1, 1, 2):  # key 1 twice (more frequent), then key 2 pushes the table over capacity
        table(torch.tensor([key])).sum().backward()
        optimizer.step()
    assert table.keys().tolist() == [1]
    table(torch.tensor([3])).sum().backward()  # reuses key 2's freed row
    assert torch.equal(table.row_state["sum"][table._find_rows(torch.tensor([3]))], torch.zeros(1, 2))


@pytest.mark.parametrize(
    "kwargs, match", [(dict(lr=-1), "invalid lr -1"), (dict(betas=(0.9, 1.0)), r"invalid betas\[1\]")]
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseAdam(DynamicEmbedding(2), **kwargs)


def test_needs_a_table():
    with pytest.raises(ValueError, match="no embedding tables found"):
        SparseSGD(nn.Linear(2, 2))
