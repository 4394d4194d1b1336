"""Autograd-aware collectives (the original Bagua's ``bagua.torch_api.data_parallel.functional``).

:func:`all_reduce` reduces a tensor across ranks inside a model's forward and carries gradients back across ranks:
its backward is another all-reduce, of the gradient, with the same op (the rule
``torch.distributed.nn.functional.all_reduce`` follows). For ``SUM``, ``y = x_0 + ... + x_{n-1}`` on every rank,
so the gradient of ``x_r`` is the sum over ranks of the gradients of ``y``: exactly that all-reduce.

Example:
    >>> from bagua.torch_api.data_parallel.functional import all_reduce
    >>> y = all_reduce(x)  # doctest: +SKIP
    >>> y.sum().backward()  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from bagua.torch_api.comm.lifecycle import torch_group_of
from bagua.torch_api.comm.reduce_op import ReduceOp, to_torch_op

__all__ = ["all_reduce"]


class _AllReduce(torch.autograd.Function):
    """Forward: an all-reduce of a copy of the input; backward: the same all-reduce of the gradient."""

    @staticmethod
    def forward(ctx: Any, op: dist.ReduceOp, group: Optional[dist.ProcessGroup], tensor: torch.Tensor) -> torch.Tensor:
        ctx.op, ctx.group = op, group
        out = tensor.clone(memory_format=torch.contiguous_format)  # the input stays as it was, for autograd
        dist.all_reduce(out, op=op, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        return None, None, _AllReduce.apply(ctx.op, ctx.group, grad_output)


def all_reduce(
    tensor: torch.Tensor, op: Union[dist.ReduceOp, ReduceOp] = dist.ReduceOp.SUM, group: Any = None
) -> torch.Tensor:
    """Return the reduction of ``tensor`` over the ranks of ``group``, differentiably.

    Args:
        tensor: this rank's input; it is not modified.
        op: a ``torch.distributed.ReduceOp`` or a Bagua :class:`~bagua.torch_api.communication.ReduceOp` (``AVG`` is
            not one: average with ``SUM`` and a division, which autograd then follows).
        group: a :class:`~bagua.torch_api.communication.BaguaProcessGroup`, a torch process group, or ``None`` for
            the default group (``torch.distributed``'s world when Bagua is not initialized).

    Returns:
        A new tensor, equal on every rank of ``group``; its backward all-reduces the gradient with ``op``. On a
        rank outside ``group``, a copy of ``tensor``.
    """
    if isinstance(op, ReduceOp):
        if op == ReduceOp.AVG:
            raise ValueError("all_reduce: ReduceOp.AVG has no torch op on every backend; use SUM and divide")
        op = to_torch_op(op)
    torch_group = torch_group_of(group)
    if group is not None and torch_group is None and dist.is_initialized():
        return tensor.clone()  # a rank outside ``group`` has nothing to reduce (as the collectives return at once)
    return _AllReduce.apply(op, torch_group, tensor)
