"""Large sparse embeddings: dynamic tables, sparse lookups, row-wise sparse optimizers."""

from trainaccel.embedding import initializers
from trainaccel.embedding.dynamic import DynamicEmbedding
from trainaccel.embedding.lookup import COMBINERS, SparseTensor, embedding_lookup_sparse
from trainaccel.embedding.optim import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseOptimizer, SparseSGD

__all__ = [
    "COMBINERS",
    "DynamicEmbedding",
    "RowWiseAdagrad",
    "SparseAdagrad",
    "SparseAdam",
    "SparseOptimizer",
    "SparseSGD",
    "SparseTensor",
    "embedding_lookup_sparse",
    "initializers",
]
