"""The bucket operation of gradient allreduce: a full-precision allreduce of the bucket, flat or hierarchical.

Example:
    >>> op = centralized_full_precision_op(group, hierarchical=False)  # doctest: +SKIP
    >>> bucket.append_op(op)  # doctest: +SKIP
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bagua.torch_api import communication as comm
from bagua.torch_api import multistream
from bagua.torch_api.comm import hierarchy
from bagua.torch_api.comm.process_group import BaguaCommunicator, BaguaProcessGroup
from bagua.torch_api.communication import ReduceOp
from bagua.torch_api.ops.base import AsyncHandle, BucketOp
from bagua.torch_api.interfaces import Bucket

__all__ = ["CentralizedFullPrecisionOp", "centralized_full_precision_op"]


class CentralizedFullPrecisionOp(BucketOp):
    """Allreduce the bucket over ``group``: the operation behind gradient allreduce.

    Flat: one allreduce (AVG or SUM). Hierarchical (when some node holds several of the group's ranks):
    reduce to each node's leader, allreduce among leaders, broadcast inside each node; with equal ranks per
    node this equals the flat average. ``scattergather``: a reduce-scatter followed by an all-gather (the
    bucket must be padded to the group size). Flat and unsplit, the op is one collective the engine may start
    from the training thread (:meth:`launch_async`).
    """

    def __init__(
        self, group: BaguaProcessGroup, hierarchical: bool = False, average: bool = True, scattergather: bool = False
    ) -> None:
        self.group, self.hierarchical, self.average, self.scattergather = group, hierarchical, average, scattergather
        self.op = ReduceOp.AVG if average else ReduceOp.SUM
        self.launches_async = not hierarchical and not scattergather

    def __call__(self, bucket: Bucket, flat: torch.Tensor) -> None:
        hierarchy.run_hierarchically(self.group, self.hierarchical, flat, self._allreduce, self.average)

    def launch_async(self, bucket: Bucket, flat: torch.Tensor) -> AsyncHandle:
        """Start the allreduce as one collective and return its handle."""
        # The flat, unsplit case is one collective: start it from the caller's thread and let the backend run it
        # (gloo's own threads, NCCL's stream) instead of handing it to Bagua's communication thread.
        c = self.group.get_global_communicator()
        if c.group is None or c.nranks() == 1:
            return AsyncHandle(None, None)
        nccl = dist.get_backend(c.group) == "nccl"
        torch_op = dist.ReduceOp.AVG if (self.average and nccl) else (dist.ReduceOp.SUM)
        work = multistream.all_reduce_async(flat, torch_op, c.group)  # several TCP streams when enabled
        finish = (lambda: flat.div_(c.nranks())) if (self.average and not nccl) else None
        return AsyncHandle(work, finish)

    def _allreduce(self, flat: torch.Tensor, c: BaguaCommunicator) -> None:
        if self.scattergather and flat.numel() % c.nranks() == 0:
            comm.reduce_scatter_inplace(flat, self.op, c)
            comm.allgather_inplace(flat, c)
        else:
            multistream.allreduce_inplace(flat, self.op, c)  # several TCP streams when enabled for c


#: The original's name of the operation's constructor.
centralized_full_precision_op = CentralizedFullPrecisionOp
