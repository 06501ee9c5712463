"""SyncBatchNorm with a scope: statistics over every worker (`global`) or over this node's workers (`node`).

Built on torch's SyncBatchNorm, whose kernels run on CUDA (and XPU/HPU); on other devices (CPU, where
torch refuses) the same statistics come from one all-gather of per-worker (count, mean, M2).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

SCOPES = ("global", "node")
_TORCH_KERNEL_DEVICES = {"cuda", "xpu", "hpu", torch._C._get_privateuse1_backend_name()}


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


def running_stats_factor(bn: _BatchNorm) -> float:
    """Count this training batch and return the running statistics' update factor (as BatchNorm does)."""
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        return 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    return 0.0


def gathered_batch_norm(
    bn: _BatchNorm, input: torch.Tensor, factor: float, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Training-mode batch norm of `input` with statistics over every rank of `group`, updating `bn`'s running ones.

    Ranks' batch sizes may differ, even be empty; gradients are those of one BatchNorm over the joined batch.
    """
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
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    stats = _AllGather.apply(stats, group) if world > 1 else stats.unsqueeze(0)
    counts, means, m2s = stats.unbind(1)
    total = counts.sum(0)
    # Single-value batches are refused as BatchNorm does. Only a rank with at most one value of its own reads the
    # joined count on the host (on a GPU that read waits for the device): with more, the joined batch has more too.
    count = n if n > 1 else int(total[0])
    if count <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {count} across {world} worker(s)")
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    if bn.training and bn.running_mean is not None:
        with torch.no_grad():
            bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
            unbiased = (m2 / (total - 1)).to(bn.running_var.dtype)
            bn.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
    scale = torch.rsqrt(m2 / total + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight
    shape = (1, -1) + (1,) * (input.dim() - 2)
    out = (x - mean.view(shape)) * scale.view(shape)  # centre first: accurate for inputs far from zero
    if bn.bias is not None:
        out = out + bn.bias.view(shape)
    return out.to(input.dtype)


class SyncBatchNorm(nn.SyncBatchNorm):
    """torch's SyncBatchNorm over `process_group`, also on devices its kernels refuse (CPU)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        distributed = dist.is_available() and dist.is_initialized()
        if input.device.type in _TORCH_KERNEL_DEVICES or not (self.training and distributed):
            return super().forward(input)
        self._check_input_dim(input)
        return gathered_batch_norm(self, input, running_stats_factor(self), self.process_group)


def _node_group() -> dist.ProcessGroup | None:
    """This node's workers as a group (None when the job is one node: the whole world)."""
    from trainaccel.comm.topology import node_group

    return node_group()


def convert_sync_batchnorm(
    module: nn.Module, scope: str = "global", process_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Every BatchNorm*d in `module` -> SyncBatchNorm over all workers (`global`) or this node's (`node`).

    `process_group` overrides the scope's group. With `node`, call it on every rank: building node groups is collective.
    """
    if scope not in SCOPES:
        raise ValueError(f"invalid scope {scope!r}; accepted: {', '.join(SCOPES)}")
    if process_group is None and scope == "node":
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("scope='node' needs the process group started (init_process_group or trainaccel.init())")
        process_group = _node_group()
    return _convert(module, process_group)


def _convert(module: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and (
        type(module) is nn.SyncBatchNorm or not isinstance(module, nn.SyncBatchNorm)
    ):
        out = SyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, group
        )
        if module.affine:
            out.weight, out.bias = module.weight, module.bias  # the same Parameters, not copies
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _convert(child, group))
    return out
