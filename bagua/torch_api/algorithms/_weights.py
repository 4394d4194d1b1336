"""Pieces shared by the algorithms that communicate weights rather than gradients (decentralized SGD, its
low-precision variant, asynchronous model averaging): which tensors they exchange, their buckets, and the checks of
their common arguments.

Example:
    >>> _check_interval(2, hierarchical=False)
    >>> _check_interval(0)
    Traceback (most recent call last):
    ...
    ValueError: ...
"""

from __future__ import annotations

from typing import Sequence

from bagua.torch_api.algorithms.checks import check_bool, check_int
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.tensor import BaguaTensor, weight_tensor

__all__: list[str] = []


def _weight_tensors(bagua_ddp) -> list[BaguaTensor]:
    """The parameters themselves (not their gradients), in reverse registration order."""
    module_name = bagua_ddp.bagua_module_name
    return [weight_tensor(p, name, module_name) for name, p in reversed(bagua_ddp.bagua_build_params())]


def _one_bucket_per_dtype(tensors: Sequence[Sequence[BaguaTensor]], do_flatten: bool) -> list[BaguaBucket]:
    by_dtype: dict[str, list[BaguaTensor]] = {}
    for t in (t for group in tensors for t in group):
        by_dtype.setdefault(str(t.dtype), []).append(t)
    return [BaguaBucket(ts, name=str(i), flatten=do_flatten) for i, (_, ts) in enumerate(sorted(by_dtype.items()))]


def _check_interval(
    communication_interval: int, hierarchical: bool = True, owner: str = "DecentralizedAlgorithm"
) -> None:
    check_bool(owner, "hierarchical", hierarchical)
    check_int(owner, "communication_interval", communication_interval, 1, "communicate every that many steps")
