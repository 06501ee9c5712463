"""Sharded tables on real Gloo workers (trainaccel run): training equals one table; checkpoints reshard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_checks
from trainaccel.embedding import SparseAdagrad, checkpoint
from trainaccel.embedding.sharded import ShardedEmbeddingCollection, row_owner

TABLES = {"a": {"dim": 4, "admit_after": 2}, "b": 3}  # as in scripts/sharded_embedding.py


@pytest.fixture(scope="module")
def saved_at_two(tmp_path_factory) -> Path:
    """Both shardings trained on 2 workers and checked against one table; the row-sharded one saved."""
    out = tmp_path_factory.mktemp("sharded")
    run_checks("sharded_embedding.py", out, 2, "train", out / "ckpt")
    return out / "ckpt"


def _merged(files: list[Path]) -> dict[str, dict[str, torch.Tensor]]:
    """Per table, every field of every rank's export, ordered by key."""
    parts = [torch.load(f, weights_only=True) for f in files]
    merged = {}
    for table in parts[0]:
        fields = {}
        for prefix in ("", "pending_"):
            keys = torch.cat([p[table][prefix + "keys"] for p in parts if table in p])
            order = torch.argsort(keys)
            for field in parts[0][table]:
                if (
                    field.startswith(prefix)
                    and (prefix or not field.startswith("pending_"))
                    and field not in ("step",)
                    and not field.startswith("scalar.")
                ):
                    fields[field] = torch.cat([p[table][field] for p in parts if table in p])[order]
        merged[table] = fields
    return merged


def _assert_same_tables(loaded: dict, truth: dict) -> None:
    assert loaded.keys() == truth.keys()
    for table in truth:
        assert loaded[table].keys() == truth[table].keys(), table
        assert truth[table]["keys"].numel() > 0
        for field, value in truth[table].items():
            assert torch.equal(loaded[table][field], value), f"{table}/{field}"


@pytest.mark.multiprocess  # saved_at_two launches the workers
def test_sharded_training_equals_one_table_on_the_global_batch(saved_at_two):
    assert sorted(p.name for p in saved_at_two.glob("shard-*")) == [
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
    ]


@pytest.mark.multiprocess  # saved_at_two launches the workers
def test_save_at_two_load_at_one(saved_at_two, tmp_path):
    collection = ShardedEmbeddingCollection(TABLES)  # no process group: one rank holds everything
    SparseAdagrad(collection)
    checkpoint.load(collection, saved_at_two)
    torch.save({n: s.export() for n, s in collection.shards.items()}, tmp_path / "loaded.pt")
    _assert_same_tables(_merged([tmp_path / "loaded.pt"]), _merged(sorted(saved_at_two.glob("truth-*.pt"))))
    assert collection.shards["a"].step == 4


@pytest.mark.multiprocess
def test_save_at_two_load_at_three(saved_at_two, tmp_path):
    run_checks("sharded_embedding.py", tmp_path, 3, "load", saved_at_two)
    loaded_files = sorted(saved_at_two.glob("loaded-3-*.pt"))
    assert len(loaded_files) == 3
    for rank, f in enumerate(loaded_files):
        for table, fields in torch.load(f, weights_only=True).items():
            assert bool((row_owner(fields["keys"], 3) == rank).all()), f"rank {rank} table {table}"
    _assert_same_tables(_merged(loaded_files), _merged(sorted(saved_at_two.glob("truth-*.pt"))))


@pytest.mark.multiprocess  # saved_at_two launches the workers
def test_load_names_what_does_not_fit(saved_at_two, tmp_path):
    with pytest.raises(ValueError, match=r"tables \{'a': 4, 'b': 3\}, this collection \{'a': 8\}"):
        checkpoint.load(ShardedEmbeddingCollection({"a": 8}), saved_at_two)
    with pytest.raises(FileNotFoundError, match="meta.json is missing"):
        checkpoint.load(ShardedEmbeddingCollection({"a": 8}), tmp_path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tables={"a": 4}, sharding="column"), "invalid sharding 'column'; accepted: row, table"),
        (dict(tables={"a": {"admit_after": 2}}), "accepted: a dim or a dict of DynamicEmbedding options with 'dim'"),
        (dict(tables={"a": -3}), "invalid dim -3"),
        (dict(tables={"a": 4}, sharding="table", placement={"a": 5}), r"invalid placement \{'a': 5\}"),
    ],
)
def test_bad_collections_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardedEmbeddingCollection(**kwargs)


def test_get_variable_is_created_once_and_looks_up_like_a_table():
    from trainaccel.embedding import SparseTensor, embedding_lookup_sparse, get_variable

    var = get_variable("test_get_variable_user", 4, initializer="zeros")
    assert get_variable("test_get_variable_user", 4).collection is var.collection
    with pytest.raises(ValueError, match="exists with dim 4, not 8"):
        get_variable("test_get_variable_user", 8)
    optimizer = SparseAdagrad(var, lr=1.0)
    ids = SparseTensor(torch.tensor([[0, 0], [0, 1], [2, 0]]), torch.tensor([10, 2**60, 10]), (3, 2))
    out = embedding_lookup_sparse(var, ids, combiner="mean")
    assert out.shape == (3, 4) and torch.equal(out, torch.zeros(3, 4))
    out.sum().backward()
    optimizer.step()
    var.eval()
    torch.testing.assert_close(var(torch.tensor([10, 2**60])), torch.full((2, 4), -1.0))  # Adagrad's first step is lr


def test_a_bad_combiner_is_named_before_the_collection_changes():
    collection = ShardedEmbeddingCollection({"a": 2})
    with pytest.raises(ValueError, match="invalid combiner 'max'"):
        collection(
            {"a": torch.empty(0, dtype=torch.int64)}, offsets={"a": torch.zeros(2, dtype=torch.int64)}, combiner="max"
        )
    assert len(collection) == 0 and collection._exchanges == []
