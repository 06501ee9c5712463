"""Horovod's PyTorch API on torch.distributed: change `import horovod.torch as hvd` to this module.

Launch with `trainaccel run` (or torchrun, mpirun, horovodrun). This version has setup and
topology, allreduce, allgather, broadcast, barrier and object collectives with their async
and in-place forms, Horovod's mismatch errors, DistributedOptimizer, broadcast_parameters and
broadcast_optimizer_state, alltoall, reducescatter and the grouped forms. The rest of the API (join,
autograd, SyncBatchNorm, elastic) comes next.
"""

from trainaccel.horovod.basics import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init, is_homogeneous,
    is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
    rocm_built, shutdown, size,
)  # fmt: skip
from trainaccel.horovod.compression import Compression
from trainaccel.horovod.optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from trainaccel.horovod.ops import (
    Adasum, Average, Handle, Max, Min, Product, ReduceOp, Sum, allgather, allgather_async, allgather_object,
    allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
    broadcast_async_, broadcast_object, grouped_allgather, grouped_allgather_async, grouped_allreduce,
    grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
    grouped_reducescatter_async, poll, reducescatter, reducescatter_async, synchronize,
)  # fmt: skip

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Handle", "broadcast_optimizer_state",
    "broadcast_parameters", "Max", "Min", "Product", "ReduceOp", "Sum",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "reducescatter", "reducescatter_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "ccl_built", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
    "gloo_enabled", "init", "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "rocm_built", "shutdown", "size",
    "synchronize",
]  # fmt: skip
