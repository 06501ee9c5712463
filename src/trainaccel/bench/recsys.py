"""Recommendation benchmarks: synthetic Criteo-shaped batches, DeepFM and Wide & Deep with a pluggable embedding.

An embedding is any module called as `emb(ids)` with ids int64 [B, 26] that returns float [B, 26, dim + 1]:
columns [:dim] are the factor vectors, column dim is the first-order (wide) weight.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from trainaccel.embedding.hashing import mix64

# Criteo Kaggle (Display Advertising Challenge) categorical cardinalities C1..C26, as counted by DLRM's
# preprocessing (facebookresearch/dlrm, data_utils.py day_fea_count for --data-set=kaggle); they sum to 33,762,577.
CRITEO_CARDINALITIES: tuple[int, ...] = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)
NUM_DENSE = 13
NUM_SPARSE = 26

_SIGNAL_DENSE = 4  # the hidden label function reads dense features 0..3 ...
_SIGNAL_SPARSE = (0, 1, 4, 5, 8, 13)  # ... and the hashed parity of these sparse features (small tables: learnable)
_POSITIVE_RATE = 0.25  # Criteo's click rate is about 25.6%
_SCRAMBLE = 2_147_483_647  # a prime above every cardinality, so multiplying by it permutes [0, card)


def feature_keys(ids: torch.Tensor) -> torch.Tensor:
    """One int64 key per (feature, id), ids int64 [B, F] in [0, 2**48): distinct pairs give distinct keys, never 0."""
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise ValueError(f"invalid ids {ids.dtype} {tuple(ids.shape)}; accepted: int64 [batch, features]")
    feature = torch.arange(1, ids.shape[1] + 1, dtype=torch.int64, device=ids.device)
    # (feature + 1) in the top 16 bits keeps the packed word nonzero and unique; the mix is a bijection, so
    # keys collide only if pairs do, and spread over the whole int64 range as a hash table would see them.
    return mix64((feature << 48) | ids)


def criteo_cardinalities(max_rows: int | None = None) -> list[int]:
    """The Criteo cardinalities, each capped at `max_rows` (to shrink tables for a benchmark)."""
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"invalid max_rows {max_rows}; accepted: an integer >= 1 or None")
    return [c if max_rows is None else min(c, max_rows) for c in CRITEO_CARDINALITIES]


class CriteoBatch(NamedTuple):
    dense: torch.Tensor  # float32 [B, 13], log1p of counts
    sparse: torch.Tensor  # int64 [B, 26]
    labels: torch.Tensor  # float32 [B], 0 or 1


class CriteoSynthetic:
    """Deterministic synthetic Criteo batches: Zipf(alpha) ids per feature and labels from a fixed hidden
    logistic function of a few dense features and sparse-key parities, so a model that trains lowers the loss."""

    keys = staticmethod(feature_keys)

    def __init__(self, seed: int = 0, alpha: float = 1.2, max_rows: int | None = None):
        if not alpha > 1:
            raise ValueError(f"invalid alpha {alpha}; accepted: a Zipf exponent > 1")
        if seed < 0:
            raise ValueError(f"invalid seed {seed}; accepted: an integer >= 0")
        self.seed, self.alpha = seed, float(alpha)
        self.cardinalities = criteo_cardinalities(max_rows)
        self._card = np.asarray(self.cardinalities, dtype=np.int64)
        rng = np.random.default_rng([seed, 0])
        # Criteo's integer features are heavy-tailed counts of very different scales.
        self._mu = rng.uniform(-0.5, 4.0, NUM_DENSE)
        self._sigma = rng.uniform(0.5, 2.0, NUM_DENSE)
        self._w_dense = rng.normal(0.0, 1.0, _SIGNAL_DENSE)
        self._w_sparse = rng.choice([-1.0, 1.0], len(_SIGNAL_SPARSE)) * rng.uniform(0.7, 1.3, len(_SIGNAL_SPARSE))
        # Calibrate once on a fixed sample: standardize the score, then pick the bias giving a 25% positive rate.
        dense, sparse = self._features(rng, 8192)
        sd = dense[:, :_SIGNAL_DENSE]
        self._d_mean, self._d_std = sd.mean(0), sd.std(0) + 1e-6
        self._bias, score = 0.0, self._score(dense, sparse)
        self._scale = 2.5 / score.std()  # sharp enough to learn, noisy enough not to be trivial
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            rate = (1 / (1 + np.exp(-(self._scale * score + mid)))).mean()
            lo, hi = (mid, hi) if rate < _POSITIVE_RATE else (lo, mid)
        self._bias = (lo + hi) / 2

    def _features(self, rng: np.random.Generator, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        counts = np.floor(np.exp(rng.normal(self._mu, self._sigma, (batch_size, NUM_DENSE))))
        dense = np.log1p(counts).astype(np.float32)
        ranks = rng.zipf(self.alpha, (batch_size, NUM_SPARSE))
        # Scramble so the hot ids are spread over the table, not packed into its first rows as bare ranks would be.
        sparse = ((ranks - 1) % self._card) * _SCRAMBLE % self._card
        return dense, sparse

    def _score(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        d = (dense[:, :_SIGNAL_DENSE] - self._d_mean) / self._d_std
        bits = (feature_keys(torch.from_numpy(sparse[:, list(_SIGNAL_SPARSE)])).numpy() >> 17) & 1
        return d @ self._w_dense + (2.0 * bits - 1.0) @ self._w_sparse

    def batch(self, batch_size: int, index: int = 0) -> CriteoBatch:
        """Batch number `index` (the same for the same seed, index and size)."""
        if batch_size < 1:
            raise ValueError(f"invalid batch_size {batch_size}; accepted: an integer >= 1")
        if index < 0:
            raise ValueError(f"invalid index {index}; accepted: an integer >= 0")
        rng = np.random.default_rng([self.seed, 1, index])
        dense, sparse = self._features(rng, batch_size)
        p = 1 / (1 + np.exp(-(self._scale * self._score(dense, sparse) + self._bias)))
        labels = (rng.random(batch_size) < p).astype(np.float32)
        return CriteoBatch(torch.from_numpy(dense), torch.from_numpy(sparse), torch.from_numpy(labels))


def _mlp(width: int, hidden: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, 1))


def fm_second_order(v: torch.Tensor) -> torch.Tensor:
    """Factorization-machine pairwise term sum_{i<j} <v_i, v_j> for v [B, F, dim], in O(F * dim): returns [B]."""
    return 0.5 * (v.sum(1).square() - v.square().sum(1)).sum(-1)


class _RecsysModel(nn.Module):
    def __init__(self, dim: int, embedding: nn.Module, hidden: Sequence[int]):
        super().__init__()
        if dim < 1:
            raise ValueError(f"invalid dim {dim}; accepted: an integer >= 1")
        if any(h < 1 for h in hidden):
            raise ValueError(f"invalid hidden {tuple(hidden)}; accepted: widths >= 1")
        self.dim, self.embedding = dim, embedding
        self.bias = nn.Parameter(torch.zeros(()))
        self.dense_linear = nn.Linear(NUM_DENSE, 1, bias=False)
        self.mlp = _mlp(NUM_SPARSE * dim + NUM_DENSE, hidden)

    def _parts(self, dense: torch.Tensor, sparse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        e = self.embedding(sparse)
        if e.shape[-1] != self.dim + 1:
            raise ValueError(
                f"the embedding gave {e.shape[-1]} columns per feature; accepted: dim + 1 = {self.dim + 1}"
            )
        v = e[..., : self.dim]
        wide = self.bias + e[..., self.dim].sum(1) + self.dense_linear(dense).squeeze(-1)
        deep = self.mlp(torch.cat([v.flatten(1), dense], 1)).squeeze(-1)
        return v, wide, deep


class DeepFM(_RecsysModel):
    """DeepFM (Guo et al. 2017, "DeepFM: A Factorization-Machine based Neural Network for CTR Prediction"):
    first-order + FM second-order + MLP, sharing one embedding; forward(dense, sparse) returns logits [B]."""

    def __init__(self, dim: int, embedding: nn.Module, hidden: Sequence[int] = (400, 400, 400)):
        super().__init__(dim, embedding, hidden)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        v, wide, deep = self._parts(dense, sparse)
        return wide + fm_second_order(v) + deep


class WideDeep(_RecsysModel):
    """Wide & Deep (Cheng et al. 2016, "Wide & Deep Learning for Recommender Systems"): a linear wide part plus
    an MLP over the factor vectors and dense features; forward(dense, sparse) returns logits [B]."""

    def __init__(self, dim: int, embedding: nn.Module, hidden: Sequence[int] = (1024, 512, 256)):
        super().__init__(dim, embedding, hidden)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        _, wide, deep = self._parts(dense, sparse)
        return wide + deep


class PerFeatureEmbeddingBags(nn.Module):
    """One dense-gradient nn.EmbeddingBag per feature, looked up one feature at a time: the baseline."""

    def __init__(self, cardinalities: Sequence[int], dim_plus_one: int, init_std: float = 0.01):
        super().__init__()
        if dim_plus_one < 2:
            raise ValueError(
                f"invalid dim_plus_one {dim_plus_one}; accepted: an integer >= 2 (dim factor columns + 1 first-order)"
            )
        if any(c < 1 for c in cardinalities):
            raise ValueError(f"invalid cardinalities {list(cardinalities)}; accepted: integers >= 1")
        self.bags = nn.ModuleList(nn.EmbeddingBag(c, dim_plus_one, mode="sum") for c in cardinalities)
        for bag in self.bags:
            # nn.EmbeddingBag's N(0, 1) init makes the FM term of 26 features explode; small weights train.
            nn.init.normal_(bag.weight, std=init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(ids.shape[0], device=ids.device)  # one id per bag
        return torch.stack([bag(ids[:, i], offsets) for i, bag in enumerate(self.bags)], 1)


def baseline_embedding(cardinalities: Sequence[int], dim_plus_one: int) -> nn.Module:
    """What a PyTorch user writes first: per-feature nn.EmbeddingBag(sum) tables with dense gradients."""
    return PerFeatureEmbeddingBags(cardinalities, dim_plus_one)


RECSYS_MODELS: dict[str, type[_RecsysModel]] = {"deepfm": DeepFM, "wide_deep": WideDeep}
