"""The original's grouping helper: index runs that lie back to back in memory in every tensor list.

Kept apart from the fuser (:mod:`bagua.torch_api.contrib.fuse.fuser`), which finds its runs itself; exported for
code written against the original, and re-exported by :mod:`bagua.torch_api.contrib.fuse.optimizer`.
"""

from __future__ import annotations

import torch

__all__ = ["calculate_mutual_groups"]


def calculate_mutual_groups(tensors_list: list[list[torch.Tensor]]) -> list[list[int]]:
    """Group the indices whose tensors lie back to back in memory in *every* list (the original's helper).

    For each list, the tensors are ordered by address and cut into maximal runs of at least two tensors in which
    each one starts where the previous one ends, in the same storage; a run is reported as its indices in address
    order. The result holds the runs found, identical, in every list: the positions that can be fused as one flat
    tensor for all of them (say parameters, gradients and an optimizer state).

    Args:
        tensors_list: lists of equal length; ``tensors_list[j][i]`` is the j-th tensor of position ``i``.

    Returns:
        The common runs, in the first list's address order; ``[]`` when there is none.

    Example:
        >>> flat = torch.zeros(30)
        >>> calculate_mutual_groups([[flat[10:20], flat[:10], torch.zeros(10)]])
        [[1, 0]]
    """
    if not tensors_list:
        return []
    size = len(tensors_list[0])
    if any(len(tensors) != size for tensors in tensors_list):
        raise ValueError(f"every list must hold the same number of tensors, got {[len(t) for t in tensors_list]}")
    common = _contiguous_runs(tensors_list[0])
    for tensors in tensors_list[1:]:
        runs = _contiguous_runs(tensors)
        common = [run for run in common if run in runs]
    return common


def _contiguous_runs(tensors: list[torch.Tensor]) -> list[list[int]]:
    order = sorted(range(len(tensors)), key=lambda i: tensors[i].data_ptr())
    runs: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and not _follows(tensors[current[-1]], tensors[i]):
            if len(current) > 1:
                runs.append(current)
            current = []
        current.append(i)
    if len(current) > 1:
        runs.append(current)
    return runs


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` starts where ``a`` ends, inside the same storage (separate allocations never count)."""
    same_storage = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    return same_storage and a.device == b.device and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
