"""SyncBatchNorm: batch normalization whose statistics span the batches of every rank, on CPU (gloo) and CUDA.

In training, each channel is normalized with the mean and variance of the *global* batch (the union of every
rank's batch; ranks may hold different batch sizes), so the layer computes what one ``BatchNorm`` computes on the
concatenated batch, and so do its gradients (Ioffe & Szegedy 2015, https://arxiv.org/abs/1502.03167; the
distributed form as in ``torch.nn.SyncBatchNorm``, which runs on CUDA only). One step:

1. forward: each rank computes ``(n, mean, M2)`` of its batch per channel (``M2 = sum (x - mean)^2``); one
   all-gather; every rank merges them exactly (Chan et al.'s parallel variance) into the global mean and biased
   variance, normalizes, and updates the running statistics with the unbiased variance.
2. backward: each rank sums ``dy`` and ``dy * (x - mean)`` per channel; one all-reduce gives the global sums, from
   which the input gradient follows. The weight and bias gradients stay local, summed over ranks afterwards by
   data-parallel training like any other gradient.

In eval mode with running statistics nothing is communicated.

Example:
    >>> model = SyncBatchNorm.convert_sync_batchnorm(model)  # doctest: +SKIP
    >>> model = model.with_bagua([optimizer], GradientAllReduceAlgorithm())  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from bagua.torch_api.comm.lifecycle import torch_group_of

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch of all ranks of ``process_group``; inputs ``(N, C, *)``.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance for stability.
        momentum: weight of the new batch in the running statistics; ``None`` keeps a cumulative average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running statistics and use them in eval mode; without them, eval mode
            normalizes with the (global) batch statistics too.
        process_group: the ranks to synchronize over: a torch ``ProcessGroup``, a ``BaguaProcessGroup`` or
            ``None`` for Bagua's default group (the torch world when Bagua is not initialized; no
            synchronization when ``torch.distributed`` is not initialized).

    Example:
        >>> bn = SyncBatchNorm(8)
        >>> bn(torch.randn(4, 8, 5, 5)).shape  # one process: a plain BatchNorm
        torch.Size([4, 8, 5, 5])
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input of shape (N, C, *), got shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"input has {input.shape[1]} channels, the layer was built for {self.num_features}")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or self.running_mean is None
        group = _resolve_group(self.process_group) if use_batch_stats else None
        if group is None:
            running = not self.training or self.track_running_stats
            return F.batch_norm(
                input, self.running_mean if running else None, self.running_var if running else None,
                self.weight, self.bias, use_batch_stats, factor, self.eps,
            )
        update = self.training and self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean if update else None,
            self.running_var if update else None, self.eps, factor, group,
        )

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Any = None) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` in ``module`` by a :class:`SyncBatchNorm` sharing its parameters and buffers.

        Args:
            module: a module containing batch-norm layers (or one itself).
            process_group: see the class.

        Returns:
            The converted module (``module`` itself when it is not a batch-norm layer).

        Example:
            >>> net = SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
            >>> type(net[0]).__name__
            'SyncBatchNorm'
        """
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                      process_group)
            if module.affine:
                out.weight = module.weight
                out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out


def _resolve_group(process_group: Any) -> Optional[dist.ProcessGroup]:
    """The torch group to synchronize over, or ``None`` when there is nothing to synchronize with."""
    group = torch_group_of(process_group)
    if group is None or dist.get_world_size(group) < 2:
        return None
    return group


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reshape a ``(C,)`` tensor to broadcast against ``x`` of shape ``(N, C, *)``."""
    return t.reshape([1, -1] + [1] * (x.dim() - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    """The two communication points of synchronized batch norm (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group):
        channels = x.shape[1]
        stat_dtype = torch.promote_types(x.dtype, torch.float32)  # half inputs keep float32 statistics
        xf = x.to(stat_dtype)
        n_local = x.numel() // channels if channels else 0
        if n_local > 0:
            mean_local = xf.mean(dim=_channel_dims(x))
            m2_local = (xf - _per_channel(mean_local, x)).pow(2).sum(dim=_channel_dims(x))
        else:
            mean_local = torch.zeros(channels, dtype=stat_dtype, device=x.device)
            m2_local = torch.zeros_like(mean_local)
        mine = torch.cat([torch.tensor([float(n_local)], dtype=stat_dtype, device=x.device), mean_local, m2_local])
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        stats = torch.stack(gathered)  # (world, 1 + 2C)
        counts, means, m2s = stats[:, :1], stats[:, 1:1 + channels], stats[:, 1 + channels:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"SyncBatchNorm needs more than one value per channel in training, got {int(total)} "
                             "over all ranks; use a larger batch or eval mode")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean).pow(2)).sum(0)
        var = m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_((m2 / (total - 1)).to(running_var.dtype), alpha=factor)
        x_hat = (xf - _per_channel(mean, x)) * _per_channel(invstd, x)
        y = x_hat
        if weight is not None:
            y = y * _per_channel(weight.to(stat_dtype), x) + _per_channel(bias.to(stat_dtype), x)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.group, ctx.has_bias = total, group, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        stat_dtype = mean.dtype
        dims = _channel_dims(x)
        dyf = dy.to(stat_dtype)
        xmu = x.to(stat_dtype) - _per_channel(mean, x)
        sum_dy_local = dyf.sum(dim=dims)
        sum_dy_xmu_local = (dyf * xmu).sum(dim=dims)
        packed = torch.cat([sum_dy_local, sum_dy_xmu_local])
        dist.all_reduce(packed, group=ctx.group)
        sum_dy, sum_dy_xmu = packed.chunk(2)
        grad_input = None
        if ctx.needs_input_grad[0]:
            scale = invstd if weight is None else invstd * weight.to(stat_dtype)
            grad_input = _per_channel(scale, x) * (
                dyf - _per_channel(sum_dy / ctx.total, x)
                - xmu * _per_channel(invstd.pow(2) * sum_dy_xmu / ctx.total, x)
            )
            grad_input = grad_input.to(x.dtype)
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu_local * invstd).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy_local.to(weight.dtype if weight is not None else dy.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


#: ``convert_sync_batchnorm(module, process_group=None)``, also reachable as a function.
convert_sync_batchnorm = SyncBatchNorm.convert_sync_batchnorm
