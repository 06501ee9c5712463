"""Large sparse embeddings: dynamic tables, sharding over ranks, sparse lookups, row-wise sparse optimizers."""

from trainaccel.embedding import checkpoint, initializers
from trainaccel.embedding.dynamic import DynamicEmbedding
from trainaccel.embedding.lookup import COMBINERS, SparseTensor, embedding_lookup_sparse
from trainaccel.embedding.optim import RowWiseAdagrad, SparseAdagrad, SparseAdam, SparseOptimizer, SparseSGD
from trainaccel.embedding.sharded import ShardedEmbeddingCollection, ShardedTable, get_variable

__all__ = [
    "COMBINERS",
    "DynamicEmbedding",
    "RowWiseAdagrad",
    "SparseAdagrad",
    "SparseAdam",
    "SparseOptimizer",
    "SparseSGD",
    "SparseTensor",
    "ShardedEmbeddingCollection",
    "ShardedTable",
    "checkpoint",
    "get_variable",
    "embedding_lookup_sparse",
    "initializers",
]
