"""Horovod's PyTorch API on torch.distributed: change `import horovod.torch as hvd` to this module.

Launch with `trainaccel run` (or torchrun, mpirun, horovodrun). See docs/horovod.md for what
is supported and what differs from Horovod.
"""

from trainaccel.horovod.autograd import allgather, allreduce, alltoall, broadcast, reducescatter
from trainaccel.horovod.basics import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init, is_homogeneous,
    is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
    rocm_built, shutdown, size,
)  # fmt: skip
from trainaccel.horovod.compression import Compression
from trainaccel.horovod.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from trainaccel.horovod.grouped import (
    grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
    grouped_allreduce_async_, grouped_reducescatter, grouped_reducescatter_async,
)  # fmt: skip
from trainaccel.horovod.ops import (
    Adasum, Average, Handle, Max, Min, Product, ReduceOp, Sum, allgather_async, allgather_object, allreduce_,
    allreduce_async, allreduce_async_, alltoall_async, barrier, broadcast_, broadcast_async, broadcast_async_,
    broadcast_object, join, poll, reducescatter_async, sparse_allreduce_async, synchronize,
)  # fmt: skip
from trainaccel.horovod.optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from trainaccel.horovod.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from trainaccel.horovod.sync_batch_norm import SyncBatchNorm
from trainaccel.horovod import elastic

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Handle", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "ProcessSet", "Product", "ReduceOp", "Sum", "SyncBatchNorm",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "gloo_built", "gloo_enabled",
    "global_process_set", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async", "synchronize",
]  # fmt: skip
