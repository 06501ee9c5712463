"""Synthetic Criteo batches, their hash keys, and DeepFM / Wide & Deep with the baseline embedding."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainaccel.bench.recsys import (
    CRITEO_CARDINALITIES,
    NUM_DENSE,
    NUM_SPARSE,
    RECSYS_MODELS,
    CriteoSynthetic,
    DeepFM,
    WideDeep,
    baseline_embedding,
    criteo_cardinalities,
    feature_keys,
    fm_second_order,
)


@pytest.fixture(autouse=True)
def one_thread():
    # On a small shared CPU, OpenMP threads spinning against other work make these tiny ops ten times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_criteo_constants_are_dlrms_kaggle_counts():
    assert NUM_DENSE == 13 and NUM_SPARSE == 26 == len(CRITEO_CARDINALITIES)
    assert sum(CRITEO_CARDINALITIES) == 33_762_577  # DLRM's total for the Kaggle set
    assert criteo_cardinalities(1000) == [min(c, 1000) for c in CRITEO_CARDINALITIES]


def test_batches_have_criteo_shapes_and_about_a_quarter_positives():
    dense, sparse, labels = CriteoSynthetic(seed=0).batch(8192)
    assert dense.shape == (8192, 13) and dense.dtype == torch.float32
    assert sparse.shape == (8192, 26) and sparse.dtype == torch.int64
    assert labels.shape == (8192,) and labels.dtype == torch.float32
    assert torch.isfinite(dense).all() and (dense >= 0).all()  # log1p of counts
    assert set(labels.unique().tolist()) == {0.0, 1.0}
    assert 0.2 < labels.mean().item() < 0.3


def test_batches_are_deterministic_per_seed_and_index():
    a = CriteoSynthetic(seed=3).batch(256, index=5)
    b = CriteoSynthetic(seed=3).batch(256, index=5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for other in (CriteoSynthetic(seed=4).batch(256, index=5), CriteoSynthetic(seed=3).batch(256, index=6)):
        assert not torch.equal(a.sparse, other.sparse) and not torch.equal(a.dense, other.dense)


def test_ids_stay_within_the_cardinalities_and_the_max_rows_cap():
    full = CriteoSynthetic(seed=0)
    capped = CriteoSynthetic(seed=0, max_rows=1000)
    assert full.cardinalities == list(CRITEO_CARDINALITIES)
    assert capped.cardinalities == [min(c, 1000) for c in CRITEO_CARDINALITIES]
    for gen in (full, capped):
        ids = gen.batch(4096).sparse
        assert (ids >= 0).all() and (ids < torch.tensor(gen.cardinalities)).all()
    assert full.batch(4096).sparse[:, 2].max() >= 1000  # the 10M-row table does use rows past the cap


def test_ids_are_zipf_skewed():
    ids = CriteoSynthetic(seed=0).batch(4096).sparse
    for feature in (2, 3, 11):  # the millions-of-rows tables
        counts = torch.unique(ids[:, feature], return_counts=True)[1].float()
        assert counts.max() >= 50 * counts.median()


def _splitmix64_reference(feature: int, ids: np.ndarray) -> np.ndarray:
    x = (np.uint64(feature + 1) << np.uint64(48)) | ids.astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))).view(np.int64)


def test_keys_are_splitmix64_of_the_pair_distinct_and_spread_over_int64():
    gen = CriteoSynthetic(seed=0)
    ids = torch.cat([gen.batch(2048).sparse, torch.arange(2048 * 26).remainder(3).view(2048, 26)])
    keys = gen.keys(ids)
    assert keys.shape == ids.shape and keys.dtype == torch.int64
    assert torch.equal(keys, feature_keys(ids.clone()))  # equal pairs, equal keys
    for f in range(26):
        assert np.array_equal(keys[:, f].numpy(), _splitmix64_reference(f, ids[:, f].numpy()))
    pairs = torch.stack([torch.arange(26).expand_as(ids), ids], -1).view(-1, 2)
    assert len(torch.unique(pairs, dim=0)) == len(torch.unique(keys)) > 1000
    # The same id in different features is a different key.
    assert len(torch.unique(feature_keys(torch.zeros(1, 26, dtype=torch.int64)))) == 26
    assert (keys != 0).all() and keys.min() < -(2**62) and keys.max() > 2**62


def test_the_fm_term_equals_the_sum_of_pairwise_dot_products():
    v = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    brute = torch.zeros(3)
    for i in range(5):
        for j in range(i + 1, 5):
            brute += (v[:, i] * v[:, j]).sum(-1)
    torch.testing.assert_close(fm_second_order(v), brute, atol=1e-5, rtol=1e-5)


def test_the_baseline_embedding_looks_up_each_features_row():
    cards = criteo_cardinalities(50)
    emb = baseline_embedding(cards, 5)
    ids = CriteoSynthetic(seed=0, max_rows=50).batch(7).sparse
    out = emb(ids)
    assert out.shape == (7, 26, 5)
    for f in range(26):
        assert torch.equal(out[:, f], emb.bags[f].weight[ids[:, f]])
    assert not any(bag.sparse for bag in emb.bags)  # dense gradients, as a first PyTorch attempt


@pytest.mark.parametrize("name", sorted(RECSYS_MODELS))
def test_models_give_one_logit_per_row(name):
    model = RECSYS_MODELS[name](4, baseline_embedding(criteo_cardinalities(100), 5))  # default hidden widths
    batch = CriteoSynthetic(seed=0, max_rows=100).batch(6)
    assert model(batch.dense, batch.sparse).shape == (6,)
    wrong = RECSYS_MODELS[name](4, baseline_embedding(criteo_cardinalities(100), 4))
    with pytest.raises(ValueError, match="gave 4 columns per feature; accepted: dim \\+ 1 = 5"):
        wrong(batch.dense, batch.sparse)


@pytest.mark.parametrize("model_class", [DeepFM, WideDeep])
def test_sgd_with_the_baseline_embedding_learns_the_hidden_labels(model_class):
    torch.manual_seed(0)
    gen = CriteoSynthetic(seed=0, max_rows=1000)
    model = model_class(8, baseline_embedding(gen.cardinalities, 9), hidden=(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    held_out = gen.batch(4096, index=10**6)

    def held_out_loss() -> float:
        with torch.no_grad():
            return F.binary_cross_entropy_with_logits(model(held_out.dense, held_out.sparse), held_out.labels).item()

    before = held_out_loss()
    for step in range(40):
        batch = gen.batch(256, index=step)
        loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = held_out_loss()
    p = held_out.labels.mean().item()
    base_rate = -(p * math.log(p) + (1 - p) * math.log(1 - p))  # what predicting the click rate alone scores
    assert after < before and after < base_rate - 0.02


def test_bad_input_is_refused_with_the_accepted_range():
    with pytest.raises(ValueError, match=r"invalid dim 0; accepted: an integer >= 1"):
        DeepFM(0, baseline_embedding([10], 2))
    with pytest.raises(ValueError, match=r"invalid dim -1; accepted: an integer >= 1"):
        WideDeep(-1, baseline_embedding([10], 2))
    for alpha in (1.0, 0.5):
        with pytest.raises(ValueError, match=rf"invalid alpha {alpha}; accepted: a Zipf exponent > 1"):
            CriteoSynthetic(alpha=alpha)
    with pytest.raises(ValueError, match=r"invalid batch_size 0; accepted: an integer >= 1"):
        CriteoSynthetic().batch(0)
    with pytest.raises(ValueError, match=r"invalid max_rows 0; accepted: an integer >= 1 or None"):
        CriteoSynthetic(max_rows=0)
    with pytest.raises(ValueError, match=r"invalid dim_plus_one 1; accepted: an integer >= 2"):
        baseline_embedding([10], 1)
