"""ByteGrad: gradients averaged in 8 bits, MinMaxUInt8 around a scatter-reduce-gather allreduce.

Bagua paper: https://arxiv.org/abs/2107.01499. With ``n`` ranks in the communicator, rank ``r`` does, per bucket
(the bucket is padded with zeros to a multiple of the group size, so it splits into ``n`` equal chunks):

1. split the flat bucket into ``n`` chunks and encode each with its own min/max
   (:mod:`bagua.torch_api.compression`);
2. all-to-all, point to point: rank ``r`` receives every rank's encoded chunk ``r`` (its own never travels);
3. decode them and add them in rank order in float32, then divide by ``n`` (``average=True``);
4. encode the reduced chunk ``r`` and all-gather the encoded chunks;
5. decode all ``n`` chunks into the bucket.

Every element is therefore quantized twice, and every rank ends with the same bytes, hence the same gradient.
Each chunk travels as segments of at most :data:`SEGMENT` elements, each sent as soon as it is encoded (every
segment repeats its chunk's min/max header, so the codes are exactly those of the whole chunk): encoding, the
network and decoding overlap; the chunks that travel are encoded before the rank's own. Hierarchical (some node holds
several of the group's ranks): a float32 intra-node reduce (average) to each node's leader, the steps above among
the leaders, an intra-node broadcast. On one node the leader is alone and the result is the exact node average.

Error feedback (``error_feedback=True``, after EF-SGD, https://arxiv.org/abs/1901.09847, and its two-sided
form DoubleSqueeze, https://arxiv.org/abs/1905.05957): each rank keeps ``e`` (one value per bucket element) and
each chunk owner keeps ``s`` (one per element of its chunk); with ``Q`` the encoding and ``D`` the decoding::

    x   = g + e                 e <- x - D(Q(x))       (the rank's own quantization error, step 1)
    y_r = mean_i D(Q(x_i))_r + s      s <- y_r - D(Q(y_r))  (the owner's error, step 4)
    result = D(Q(y))

so no part of a gradient is lost for good: what quantization drops in one step is sent in the next ones.

Example:
    >>> from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    >>> model = model.with_bagua([optimizer], ByteGradAlgorithm(error_feedback=True))  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from bagua.torch_api.algorithms._checks import check_bool, check_choice
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms.nonfinite import (
    NONFINITE_POLICIES,
    FiniteVerdicts,
    check_finite_after_communication,
)
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.compressed_allreduce import (  # noqa: F401  (the collective's names, as the original had them here)
    SEGMENT,
    Workspace,
    all_finite,
    centralized_low_precision_op,
    low_precision_allreduce_inplace,
)
from bagua.torch_api.process_group import BaguaProcessGroup

__all__ = [
    "SEGMENT",
    "ByteGradAlgorithm",
    "ByteGradAlgorithmImpl",
    "Workspace",
    "low_precision_allreduce_inplace",
    "centralized_low_precision_op",
    "all_finite",
    "FiniteVerdicts",
]


class ByteGradAlgorithmImpl(AlgorithmImpl):
    """ByteGrad bound to a group; see :class:`ByteGradAlgorithm`."""

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        hierarchical: bool = True,
        average: bool = True,
        error_feedback: bool = False,
        nonfinite: str = "propagate",
    ) -> None:
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.average = average
        self.error_feedback = error_feedback
        self.nonfinite = nonfinite
        self._verdicts = FiniteVerdicts()
        self._ops: dict[str, Any] = {}  # bucket name -> its operation (which holds the residuals)

    def init_post_backward_hook(self, bagua_ddp):
        def hook() -> None:
            bagua_ddp.launch_remaining_buckets()
            bagua_ddp.wait_pending_comm_ops()
            check_finite_after_communication(bagua_ddp, self.nonfinite, "ByteGrad", self._verdicts.take())

        return hook

    def tensors_to_buckets(self, tensors, do_flatten: bool) -> list[BaguaBucket]:
        # padded to the group size so that every bucket splits into one equal chunk per rank
        alignment = self.process_group.get_global_communicator().nranks()
        return [
            BaguaBucket(group, name=str(i), flatten=do_flatten, alignment=alignment) for i, group in enumerate(tensors)
        ]

    def init_operations(self, bagua_ddp, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        op = centralized_low_precision_op(
            self.process_group,
            self.hierarchical,
            self.average,
            error_feedback=self.error_feedback,
            on_finite=None if self.nonfinite == "ignore" else self._verdicts.record,
        )
        self._ops[bucket.name] = op
        bucket.append_op(op)

    def state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """With error feedback, this rank's residuals per bucket (``<bucket>.residual``, ``<bucket>.server_residual``);
        they differ between ranks. ``None`` without error feedback (the ranks' states are identical)."""
        if not self.error_feedback:
            return None
        return {f"{name}.{key}": t for name, op in self._ops.items() for key, t in op.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, op in self._ops.items():
            op.load_state_dict({k[len(name) + 1 :]: t for k, t in state.items() if k.startswith(f"{name}.")})


@GlobalAlgorithmRegistry.register("bytegrad", description="gradients averaged in 8 bits (MinMaxUInt8 scatter-gather)")
@dataclass
class ByteGradAlgorithm(Algorithm):
    """Average gradients after every backward, sending them in 8 bits (about 4x less than float32).

    Args:
        hierarchical: reduce inside each node in float32 and compress only among node leaders; this sends less
            over the slow inter-node network when there are several ranks per node.
        average: average the gradients (True) or sum them (False).
        error_feedback: add each rank's quantization error of the previous steps to its gradient before
            compressing (and the chunk owners' error of the second quantization likewise), so that
            quantization errors do not accumulate; costs one float32 copy of the gradients in memory.
        nonfinite: what to do when a gradient holds NaN/Inf (8-bit compression spreads it over its whole chunk,
            identically on every rank): ``"propagate"`` (the default: the non-finite values stay in the averaged
            gradients of every rank, so ``torch.amp.GradScaler`` skips the step on every rank and lowers its
            scale, as under DDP), ``"raise"``
            (``FloatingPointError`` on every rank), ``"skip"`` (drop the step's gradients on every rank, so a
            plain optimizer skips the step; not for GradScaler, which needs the non-finite values to see the
            overflow) or ``"ignore"`` (nothing, residuals included). Except with ``"ignore"``, the error-feedback
            residuals keep their values from before that step.

    Example:
        >>> from bagua.torch_api.algorithms import bytegrad
        >>> model = model.with_bagua([optimizer], bytegrad.ByteGradAlgorithm())  # doctest: +SKIP
    """

    hierarchical: bool = True
    average: bool = True
    error_feedback: bool = False
    nonfinite: str = "propagate"

    def __post_init__(self) -> None:
        for name in ("hierarchical", "average", "error_feedback"):
            check_bool("ByteGradAlgorithm", name, getattr(self, name))
        check_choice("ByteGradAlgorithm", "nonfinite", self.nonfinite, NONFINITE_POLICIES)

    def reify(self, process_group: BaguaProcessGroup) -> ByteGradAlgorithmImpl:
        return ByteGradAlgorithmImpl(
            process_group,
            hierarchical=self.hierarchical,
            average=self.average,
            error_feedback=self.error_feedback,
            nonfinite=self.nonfinite,
        )
