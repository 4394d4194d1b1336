"""Robust aggregation: a round's average that one lying worker cannot drag far, at the cost of an all-gather.

With ``FaultTolerance(..., robust="median")`` or ``robust="trimmed_mean"``, :meth:`~bagua.torch_api.fault.
collectives.MemberCollectives.allreduce` all-gathers every member's float32 tensor instead of summing them, and
every member computes, coordinate by coordinate over the sources kept (a healed member, or one left out by the
screen of :mod:`~bagua.torch_api.fault.screen`, does not count):

- ``"median"``: the median (the mean of the two middle values for an even count);
- ``"trimmed_mean"``: the mean after dropping the ``trim`` lowest and ``trim`` highest values (default 1); with
  fewer than ``2 * trim + 1`` sources, the median.

Every source counts once: the samples each claims do not weigh a robust average. Every member holds the same
tensors in the same order, so every member computes the same result, bit for bit. The cost: each member sends its
tensor to each other member, ``(members - 1) * 4 * numel`` bytes, against ``2 * (members - 1) / members * 4 *
numel`` for the ring allreduce of the plain average (at 4 members, 2x the bytes), and holds ``members`` copies.

Example:
    >>> rows = torch.tensor([[1.0, 5.0], [2.0, -100.0], [3.0, 6.0], [1e6, 7.0]])
    >>> robust_average(rows, "trimmed_mean", trim=1)
    tensor([2.5000, 5.5000])
    >>> robust_average(rows[:3], "median")
    tensor([2., 5.])
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["ROBUST", "robust_average", "kept_rows", "robust_allgather_bytes"]

#: the robust aggregations :class:`~bagua.torch_api.fault.replica.FaultTolerance` takes as ``robust=``
ROBUST = ("median", "trimmed_mean")


def robust_average(rows: torch.Tensor, how: str, trim: int = 1) -> torch.Tensor:
    """The coordinate-wise ``how`` (``"median"`` or ``"trimmed_mean"``) of ``rows`` (one source per row)."""
    if how not in ROBUST:
        raise ValueError(f"robust={how!r} is not a robust aggregation; available: {', '.join(ROBUST)} (or None: the "
                         "plain average)")
    k = rows.shape[0]
    ordered = rows.sort(dim=0).values
    if how == "trimmed_mean" and k >= 2 * trim + 1:
        return ordered[trim : k - trim].mean(dim=0)
    if k % 2:
        return ordered[k // 2].clone()
    return (ordered[k // 2 - 1] + ordered[k // 2]) / 2


def kept_rows(gathered: Sequence[torch.Tensor], weights: Sequence[int]) -> torch.Tensor:
    """The gathered tensors of the sources kept (weight above 0), stacked as rows, in member order."""
    return torch.stack([t.reshape(-1) for t, w in zip(gathered, weights) if w])


def robust_allgather_bytes(numel: int, members: int) -> int:
    """Bytes one member sends in the all-gather of a robust average of ``numel`` float32 values."""
    return (members - 1) * 4 * numel
