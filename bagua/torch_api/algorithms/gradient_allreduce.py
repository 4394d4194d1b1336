"""Gradient allreduce: synchronous data parallelism, the equivalent of torch DDP.

After backward, every rank holds the average (or sum) of all ranks' gradients. Buckets are allreduced as soon as
all their gradients are ready, while backward goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from bagua.torch_api.algorithms.checks import check_bool
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.comm.process_group import BaguaProcessGroup

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]


class GradientAllReduceAlgorithmImpl(AlgorithmImpl):
    """Gradient allreduce bound to a group; see :class:`GradientAllReduceAlgorithm`."""

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = False, average: bool = True) -> None:
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.average = average

    def init_operations(self, bagua_ddp, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=self.average, group=self.process_group
        )


@GlobalAlgorithmRegistry.register("gradient_allreduce", description="synchronous gradient averaging (like DDP)")
@dataclass
class GradientAllReduceAlgorithm(Algorithm):
    """Average (or sum) gradients over all ranks after every backward.

    Args:
        hierarchical: reduce inside each node, allreduce among node leaders, broadcast inside each node; this
            sends less over the slow inter-node network when there are several ranks per node.
        average: average the gradients (True) or sum them (False).

    Example:
        >>> from bagua.torch_api.algorithms import gradient_allreduce
        >>> algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
        >>> model = model.with_bagua([optimizer], algorithm)  # doctest: +SKIP
    """

    replica_hook: ClassVar[Optional[str]] = "allreduce"

    hierarchical: bool = False
    average: bool = True

    def __post_init__(self) -> None:
        for name in ("hierarchical", "average"):
            check_bool(type(self).__name__, name, getattr(self, name))

    def reify(self, process_group: BaguaProcessGroup) -> GradientAllReduceAlgorithmImpl:
        return GradientAllReduceAlgorithmImpl(process_group, hierarchical=self.hierarchical, average=self.average)
