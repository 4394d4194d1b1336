"""A trial's two pure pieces: the bucket plan it applies and the throughput figures its window reads.

Example:
    >>> batch_size({"input_ids": torch.zeros(8, 128)})
    8
    >>> robust_elapsed([1.0, 1.1, 0.9, 5.0])  # the 5 s iteration (a checkpoint) counts at the median
    4.1
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from bagua.torch_api.bucket import split_bucket_by_bucket_size

__all__ = ["batch_size", "bucket_plan", "robust_elapsed"]


def bucket_plan(tensors: list, order: Optional[list[str]], bucket_size: int) -> list[list[str]]:
    """Tensor names grouped into buckets of ``bucket_size`` bytes, tensors taken in ``order`` (names; tensors
    missing from it follow in their own order), split per dtype as the engine does."""
    by_name = {t.name: t for t in tensors}
    ordered = [by_name[n] for n in (order or []) if n in by_name]
    seen = {t.name for t in ordered}
    ordered += [t for t in tensors if t.name not in seen]
    return [[t.name for t in group] for group in split_bucket_by_bucket_size(ordered, bucket_size)]


def batch_size(inputs: Any) -> int:
    """The leading dimension of the first tensor found in ``inputs`` (1 when there is none)."""
    stack = [inputs]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return int(item.shape[0]) if item.dim() > 0 else 1
        if isinstance(item, (list, tuple)):
            stack = list(item) + stack
        elif isinstance(item, dict):
            stack = list(item.values()) + stack
    return 1


def robust_elapsed(durations: list[float]) -> float:
    """Sum of iteration times, each outlier (over twice the median) counted at the median."""
    if not durations:
        return 0.0
    median = sorted(durations)[len(durations) // 2]
    return sum(d if d <= 2 * median else median for d in durations)
