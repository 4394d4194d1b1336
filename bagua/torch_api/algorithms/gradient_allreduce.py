"""Gradient allreduce: synchronous data parallelism, the equivalent of torch DDP.

After backward, every rank holds the average (or sum) of all ranks' gradients. Buckets are allreduced as soon as
all their gradients are ready, while backward goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Union

from bagua.torch_api.algorithms.checks import check_bool
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms.fault_steps import FaultTolerantStepsImpl, check_fault_tolerance
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.fault.replica import FaultTolerance

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
        fault_tolerance: a :class:`~bagua.torch_api.fault.replica.FaultTolerance`: this process is one worker of
            a job whose workers fail alone; each step's gradients are averaged over that step's live workers
            (docs/fault_tolerance.md, "Synchronous jobs").

    Example:
        >>> from bagua.torch_api.algorithms import gradient_allreduce
        >>> algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
        >>> model = model.with_bagua([optimizer], algorithm)  # doctest: +SKIP
    """

    replica_hook: ClassVar[Optional[str]] = "allreduce"

    hierarchical: bool = False
    average: bool = True
    fault_tolerance: Optional[FaultTolerance] = None

    def __post_init__(self) -> None:
        for name in ("hierarchical", "average"):
            check_bool(type(self).__name__, name, getattr(self, name))
        if self.fault_tolerance is not None:
            check_fault_tolerance(type(self).__name__, self.fault_tolerance, self.average)

    def reify(self, process_group: BaguaProcessGroup) -> Union[GradientAllReduceAlgorithmImpl, FaultTolerantStepsImpl]:
        if self.fault_tolerance is not None:
            return FaultTolerantStepsImpl(process_group, self.fault_tolerance, type(self).__name__)
        return GradientAllReduceAlgorithmImpl(process_group, hierarchical=self.hierarchical, average=self.average)
