"""Bagua's reduction operators (:class:`ReduceOp`, the original's values) and their translation to torch's.

Part of :mod:`bagua.torch_api.communication`, which re-exports :class:`ReduceOp`. ``AVG`` runs as a ``SUM`` followed
by a division (:func:`finish_avg`), except where the backend averages itself; :func:`to_torch_op` gives the op to run.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

__all__ = ["ReduceOp", "to_torch_op", "finish_avg"]


class ReduceOp(enum.IntEnum):
    """Reduction operators; values match the original Bagua (and Aluminum)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}


def to_torch_op(op: ReduceOp) -> dist.ReduceOp:
    """Return the torch operator that runs ``op`` (``SUM`` for ``AVG``, which :func:`finish_avg` completes).

    Example:
        >>> to_torch_op(ReduceOp.AVG) == dist.ReduceOp.SUM
        True
    """
    op = ReduceOp(op)
    if op == ReduceOp.AVG:
        return dist.ReduceOp.SUM
    return _TORCH_OPS[op]


def finish_avg(tensor: torch.Tensor, op: ReduceOp, n: int) -> None:
    """Divide ``tensor`` by ``n`` in place when ``op`` is ``AVG`` (floor division for integers); else do nothing."""
    if ReduceOp(op) == ReduceOp.AVG:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(n)
        else:
            tensor.floor_divide_(n)
