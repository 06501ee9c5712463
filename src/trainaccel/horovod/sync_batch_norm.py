"""Horovod's SyncBatchNorm: batch normalization whose statistics cover the batches of all workers."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from trainaccel.batchnorm import gathered_batch_norm, running_stats_factor
from trainaccel.horovod import background, process_sets


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over N, C, ... input whose training statistics span every worker in `process_set`.

    Ranks' batch sizes may differ, even be empty; gradients are those of one BatchNorm over the joined batch.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: process_sets.ProcessSet | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set  # None: all workers

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not 2 <= input.dim() <= 5:
            raise ValueError(f"expected 2D to 5D input (N, C, ...) as for BatchNorm1d/2d/3d, got {input.dim()}D input")
        if input.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels in dim 1, got input of shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize with the process set's batch statistics in training, with the running ones in eval."""
        self._check_input_dim(input)
        if not self.training and self.running_mean is not None:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, training=False, eps=self.eps
            )
        group = None
        if dist.is_available() and dist.is_initialized():
            group = process_sets.resolve(self.process_set).group
            # Its collectives run on this thread, in forward and backward: DistributedOptimizer's must stay in
            # order with them, so they run here too.
            background.keep_inline()
        return gathered_batch_norm(self, input, running_stats_factor(self), group)
