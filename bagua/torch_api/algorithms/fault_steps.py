"""The engine's side of a fault-tolerant synchronous algorithm: ``with_bagua`` hooks driving
:class:`~bagua.torch_api.fault.synchronous.SyncSteps`.

``GradientAllReduceAlgorithm(fault_tolerance=ft)`` and ``ByteGradAlgorithm(fault_tolerance=ft, codec="uint8")``
reify to :class:`FaultTolerantStepsImpl`: the model's group is one process (each worker a job of its own), no
bucket communicates; the forward pre-hook joins the job and starts the step's agreement, the post-backward hook
averages the gradients over the step's live workers (docs/fault_tolerance.md, "Synchronous jobs").

Example:
    >>> ft = FaultTolerance("10.0.0.1:29600", worker="site-a", workers=3)  # doctest: +SKIP
    >>> model = model.with_bagua([opt], GradientAllReduceAlgorithm(fault_tolerance=ft))  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from bagua.torch_api.algorithms.base import AlgorithmImpl
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.fault.replica import FaultTolerance
from bagua.torch_api.fault.synchronous import SyncSteps

__all__ = ["FaultTolerantStepsImpl", "check_fault_tolerance"]


def check_fault_tolerance(owner: str, ft: Any, average: bool) -> None:
    """Refuse, before anything is built, what a fault-tolerant synchronous algorithm does not run, saying why."""
    if not isinstance(ft, FaultTolerance):
        raise ValueError(f"{owner}(fault_tolerance=...) takes a bagua.torch_api.fault.FaultTolerance, got {ft!r}")
    if not average:
        raise ValueError(f"{owner}(fault_tolerance=..., average=False): the live workers' gradients are averaged "
                         "(a sum would change with the number of live workers); use average=True")


class FaultTolerantStepsImpl(AlgorithmImpl):
    """A synchronous algorithm whose steps are rounds over the live workers; see the module docstring.

    Args:
        process_group: the model's group: one process (this worker).
        ft: this worker's :class:`~bagua.torch_api.fault.replica.FaultTolerance`.
        owner: the algorithm's class name, for messages.
        codec, block_size, error_feedback: see :class:`~bagua.torch_api.fault.synchronous.SyncSteps`.
    """

    def __init__(self, process_group: BaguaProcessGroup, ft: FaultTolerance, owner: str,
                 codec: Optional[str] = None, block_size: int = 4096, error_feedback: bool = False) -> None:
        super().__init__(process_group)
        if len(process_group.ranks) != 1:
            raise ValueError(f"{owner}(fault_tolerance=...): each worker is one replica (a job of its own); this "
                             f"model's group has {len(process_group.ranks)} ranks. Start one process per worker "
                             "(no launcher, or a launcher job per worker)")
        # user settings
        self.ft, self.owner = ft, owner
        self.codec, self.block_size, self.error_feedback = codec, block_size, error_feedback
        # internal state
        self.steps: Optional[SyncSteps] = None

    def init_tensors(self, bagua_ddp: Any) -> list:
        if self.steps is None:
            params = [p for _, p in bagua_ddp.bagua_build_params()]
            if not params:
                raise ValueError(f"{self.owner}(fault_tolerance=...): the model has no trainable parameter")
            if len(bagua_ddp.bagua_optimizers) != 1:
                raise ValueError(f"{self.owner}(fault_tolerance=...) heals a joining worker with one optimizer's "
                                 f"state; this model has {len(bagua_ddp.bagua_optimizers)}: wrap it with one")
            self.steps = SyncSteps(self.ft, params, bagua_ddp.bagua_optimizers[0], codec=self.codec,
                                   block_size=self.block_size, error_feedback=self.error_feedback,
                                   name=self.owner, buffers=list(bagua_ddp.module.buffers()))
        return []  # no bucket: the gradients travel in the post-backward hook, over the step's live workers

    def init_operations(self, bagua_ddp: Any, bucket: Any) -> None:
        bucket.clear_ops()

    def init_forward_pre_hook(self, bagua_ddp: Any) -> Callable[[Any], None]:
        def hook(inputs: Any) -> None:
            assert self.steps is not None
            self.steps.before_forward()

        return hook

    def init_backward_hook(self, bagua_ddp: Any) -> Callable[[str, torch.Tensor], None]:
        return lambda name, param: None

    def init_post_backward_hook(self, bagua_ddp: Any) -> Callable[[], None]:
        def hook() -> None:
            assert self.steps is not None
            self.steps.after_backward()

        return hook

    def accepts_hierarchical(self, hierarchical: bool) -> bool:
        return False
