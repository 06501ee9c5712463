"""Horovod's SyncBatchNorm: batch normalization whose statistics cover the batches of all workers."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from trainaccel.horovod import process_sets


class _AllGather(torch.autograd.Function):
    """Stack every rank's tensor along a new first dimension; differentiable."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = tensor.new_empty((dist.get_world_size(group), *tensor.shape))
        # A list of views rather than all_gather_into_tensor, which Gloo refuses for stacked outputs.
        dist.all_gather(list(out.unbind(0)), tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every rank's loss used every rank's statistics, so this rank's slice gets the sum over ranks.
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may share the buffer
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over N, C, ... input whose training statistics span every worker in `process_set`.

    Ranks' batch sizes may differ, even be empty; gradients are those of one BatchNorm over the joined batch.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set: process_sets.ProcessSet | None = None) -> None:
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
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                training=False, eps=self.eps)
        factor = 0.0
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        return self._normalize(input, factor)

    def _normalize(self, input: torch.Tensor, factor: float) -> torch.Tensor:
        dims = [0, *range(2, input.dim())]
        x = input.to(torch.promote_types(input.dtype, torch.float32))  # float32 statistics even for half input
        n = input.numel() // input.shape[1]
        if n:
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            m2 = var * n
        else:  # an empty batch adds nothing, yet its rank joins the collective and the backward
            mean = m2 = x.sum(dims)
        # Chan's parallel combination of per-rank (count, mean, M2): one all-gather, and no cancellation
        # of large sums of squares as sum/sumsq would suffer; counts weigh uneven and empty batches.
        stats = torch.stack([mean.new_full(mean.shape, n), mean, m2])
        group, world = None, 1
        if dist.is_available() and dist.is_initialized():
            group = process_sets.resolve(self.process_set).group
            world = dist.get_world_size(group)
        stats = _AllGather.apply(stats, group) if world > 1 else stats.unsqueeze(0)
        counts, means, m2s = stats.unbind(1)
        total = counts.sum(0)
        count = int(total[0])  # on the host, to refuse single-value batches as BatchNorm does
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {count} "
                             f"across {world} worker(s)")
        mean = (counts * means).sum(0) / total
        m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
        if self.training and self.running_mean is not None:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                unbiased = (m2 / (count - 1)).to(self.running_var.dtype)
                self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        scale = torch.rsqrt(m2 / total + self.eps)
        if self.weight is not None:
            scale = scale * self.weight
        shape = (1, -1) + (1,) * (input.dim() - 2)
        out = (x - mean.view(shape)) * scale.view(shape)  # centre first: accurate for inputs far from zero
        if self.bias is not None:
            out = out + self.bias.view(shape)
        return out.to(input.dtype)
