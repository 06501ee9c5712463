"""DynamicEmbedding: collision-free growth, admission, eviction, export and load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainaccel.embedding import DynamicEmbedding, SparseAdagrad, SparseSGD, initializers
from trainaccel.embedding.hashing import mix64


def test_mix64_is_splitmix64():
    x = np.array([0, 1, -1, 2**63 - 1, -(2**63), 1234567890123], dtype=np.int64)
    z = x.view(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    assert mix64(torch.from_numpy(x)).tolist() == z.view(np.int64).tolist()


def _train_lookup(table: DynamicEmbedding, keys: torch.Tensor) -> torch.Tensor:
    out = table.rows_for(keys)
    table.take_gradients()
    return out


def test_every_key_reads_back_its_own_row_through_growth():
    g = torch.Generator().manual_seed(0)
    keys = torch.unique(torch.randint(-(2**63), 2**63 - 1, (60_000,), generator=g))
    keys = torch.cat(
        [
            torch.tensor([-(2**63), 2**63 - 1, 0, -1]),
            keys[~torch.isin(keys, torch.tensor([-(2**63), 2**63 - 1, 0, -1]))],
        ]
    )
    table = DynamicEmbedding(3, initial_capacity=16)
    for chunk in keys.split(7_000):  # the index and the rows grow several times
        _train_lookup(table, chunk)
    assert len(table) == keys.numel()
    rows = table._find_rows(keys)
    assert (rows >= 0).all() and torch.unique(rows).numel() == keys.numel()  # no two keys share a row
    table.eval()
    assert torch.equal(table(keys), initializers.normal()(keys, 3))  # each row is its key's own
    assert torch.equal(table.keys(), torch.sort(keys).values)


def test_trained_rows_survive_growth():
    table = DynamicEmbedding(2, initial_capacity=4, initializer="zeros")
    optimizer = SparseSGD(table, lr=1.0)
    table(torch.tensor([5, 6])).sum().backward()
    optimizer.step()
    for start in range(0, 5000, 1000):
        _train_lookup(table, torch.arange(start + 100, start + 1100))
    table.eval()
    assert torch.equal(table(torch.tensor([5, 6])), torch.full((2, 2), -1.0))


def test_a_key_is_admitted_after_it_has_been_seen_admit_after_times():
    table = DynamicEmbedding(2, admit_after=3, initializer=1.0, default_value=-5.0)
    optimizer = SparseSGD(table, lr=1.0)
    seen = []
    for _ in range(4):
        out = table(torch.tensor([7]))
        seen.append(out.detach().clone())
        out.sum().backward()
        optimizer.step()
    assert [s.tolist() for s in seen] == [[[-5.0, -5.0]], [[-5.0, -5.0]], [[1.0, 1.0]], [[0.0, 0.0]]]
    assert len(table) == 1 and table.export()["counts"].tolist() == [4]


def test_eval_lookups_change_nothing():
    table = DynamicEmbedding(2, default_value=0.5)
    table.eval()
    assert torch.equal(table(torch.tensor([1, 2])), torch.full((2, 2), 0.5))
    assert len(table) == 0 and table.export()["pending_keys"].numel() == 0
    table.train()
    with torch.no_grad():
        table(torch.tensor([1]))
    assert len(table) == 0


def test_ttl_evicts_keys_unseen_for_more_than_ttl_steps():
    table = DynamicEmbedding(2, ttl=2, initializer="zeros")
    optimizer = SparseSGD(table, lr=1.0)
    for step in range(5):
        keys = torch.tensor([1, 2]) if step == 0 else torch.tensor([2])
        table(keys).sum().backward()
        optimizer.step()
        assert table.keys().tolist() == ([1, 2] if step < 2 else [2]), step
    table(torch.tensor([1])).sum().backward()  # key 1 comes back with a fresh row
    assert table(torch.tensor([1])).tolist() == [[0.0, 0.0]]


def test_capacity_evicts_the_least_frequently_used():
    table = DynamicEmbedding(2, capacity=2)
    optimizer = SparseSGD(table)
    for keys in ([1, 2, 1, 3, 3, 3], [4]):
        table(torch.tensor(keys)).sum().backward()
        optimizer.step()
    assert table.keys().tolist() == [1, 3]  # 2 (seen once, earlier than 4) then 4 went


def test_export_load_round_trip_with_optimizer_state():
    table = DynamicEmbedding(3, admit_after=2)
    optimizer = SparseAdagrad(table, lr=0.1)
    for keys in ([1, 2, 3], [1, 2, 9], [2, 10, 11]):
        table(torch.tensor(keys)).pow(2).sum().backward()
        optimizer.step()
    state = table.state_dict()
    assert state["keys"].tolist() == [1, 2] and state["pending_keys"].tolist() == [3, 9, 10, 11]

    fresh = DynamicEmbedding(3, admit_after=2)
    fresh.load_state_dict(state)
    SparseAdagrad(fresh, lr=0.1)  # state loaded before the optimizer existed is handed to it
    restored = fresh.state_dict()
    assert restored.keys() == state.keys()
    for name in state:
        assert torch.equal(restored[name], state[name]), name
    assert fresh.step == 3


def test_load_rejects_missing_and_unknown_entries():
    table = DynamicEmbedding(2)
    with pytest.raises(RuntimeError, match="Missing key"):
        table.load_state_dict({})
    state = table.state_dict() | {"bogus": torch.zeros(1)}
    with pytest.raises(RuntimeError, match="Unexpected key.*bogus"):
        table.load_state_dict(state)


def test_memory_stays_within_half_again_of_the_rows_and_their_state():
    table = DynamicEmbedding(16)
    SparseAdagrad(table)
    keys = torch.randint(-(2**63), 2**63 - 1, (200_000,), generator=torch.Generator().manual_seed(1)).unique()
    for chunk in keys.split(20_000):
        _train_lookup(table, chunk)
    payload = len(table) * 16 * 4 * 2  # rows + Adagrad's sum
    assert table.memory_bytes() <= 1.5 * payload, table.memory_bytes() / payload


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dim=-4), "invalid dim -4; accepted: an integer >= 1"),
        (dict(dim=0), "invalid dim 0"),
        (dict(dim=2, admit_after=0), "invalid admit_after 0"),
        (dict(dim=2, ttl=0), "invalid ttl 0; accepted: an integer >= 1 or None"),
        (dict(dim=2, initializer="xavier"), "invalid initializer 'xavier'"),
        (dict(dim=2, dtype=torch.int64), "invalid dtype torch.int64"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicEmbedding(**kwargs)


def test_non_integer_ids_are_named():
    with pytest.raises(TypeError, match="invalid ids dtype torch.float32"):
        DynamicEmbedding(2)(torch.tensor([1.0]))


def test_training_lookups_without_a_step_are_warned_about():
    table = DynamicEmbedding(2)
    with pytest.warns(UserWarning, match=r"1024 training lookups .*\(is one attached\?\)"):
        for _ in range(1024):
            table(torch.tensor([1]))
    SparseSGD(table).step()
    assert table._pending == []
