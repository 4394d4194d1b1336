"""ByteGrad: gradients averaged in 8 bits, MinMaxUInt8 around a scatter-reduce-gather allreduce.

Bagua paper: https://arxiv.org/abs/2107.01499. With ``n`` ranks in the communicator and the default
``codec="chunk"``, rank ``r`` does, per bucket (the bucket is padded with zeros to a multiple of the group size, so
it splits into ``n`` equal chunks):

1. split the flat bucket into ``n`` chunks and encode each with its own min/max
   (:mod:`bagua.torch_api.codecs.minmax_uint8`);
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

Codecs (``codec=``): ``"chunk"`` is the above, one min/max per rank chunk (the original's code, kept bit for bit).
``"uint8"`` and ``"uint4"`` take one min/max per block of ``block_size`` consecutive elements of the bucket
(:mod:`bagua.torch_api.codecs.block`, 8 or 4 bits per value, 8 header bytes per block), with the same
scatter-reduce-gather and error feedback (:mod:`bagua.torch_api.codecs.block_allreduce`): chunks are whole blocks and
the bucket is not padded. Per element, one quantization errs by at most
:func:`~bagua.torch_api.codecs.block.error_bound` ``= r / (2 L) + 2**-19 M`` (``r``, ``M``: the range and largest
magnitude of its block; ``L = 255`` or ``15``), so a small tensor keeps its own resolution instead of that of the
largest tensor of its chunk.

Mixed precision: the residuals are in the units of the gradients the engine sees, which ``torch.amp.GradScaler``
scales. Pass the scaler (``grad_scaler=``) and, when its scale changes (an overflow halves it, a growth interval
doubles it), the residuals are multiplied by ``new_scale / old_scale`` before the step's exchange. Without it
the residual carried across a change is applied at the wrong scale once (e.g. twice its weight after a halving).

Example:
    >>> from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    >>> model = model.with_bagua([optimizer], ByteGradAlgorithm(error_feedback=True))  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from bagua.torch_api.algorithms.checks import check_bool, check_choice
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms.fault_steps import FaultTolerantStepsImpl, check_fault_tolerance
from bagua.torch_api.algorithms.nonfinite import (
    NONFINITE_POLICIES,
    FiniteVerdicts,
    check_finite_after_communication,
)
from bagua.torch_api.codecs.block import DEFAULT_BLOCK
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.codecs.compressed_allreduce import (  # noqa: F401  (the collective's names, as the original had them here)
    SEGMENT,
    Workspace,
    all_finite,
    low_precision_allreduce_inplace,
)
from bagua.torch_api.ops.compressed import (
    CODECS,
    CentralizedLowPrecisionOp,
    centralized_low_precision_op,
    check_codec,
)
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.codecs.registry import GlobalCodecRegistry
from bagua.torch_api.fault.replica import FaultTolerance

__all__ = [
    "SEGMENT",
    "CODECS",
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
        codec: str = "chunk",
        block_size: int = DEFAULT_BLOCK,
        grad_scaler: Optional[Any] = None,
    ) -> None:
        super().__init__(process_group)
        # user settings
        self.hierarchical, self.average, self.error_feedback = hierarchical, average, error_feedback
        self.nonfinite, self.block_size, self.grad_scaler = nonfinite, block_size, grad_scaler
        self.codec = check_codec("ByteGradAlgorithm", codec, block_size)  # an alias becomes the codec's name
        # internal state
        self._verdicts = FiniteVerdicts()
        self._ops: dict[str, CentralizedLowPrecisionOp] = {}  # bucket name -> its op (which holds the residuals)
        self._scale: Optional[float] = None  # the scaler's scale for this step's gradients

    def init_forward_pre_hook(self, bagua_ddp):
        if self.grad_scaler is None or not self.error_feedback:
            return super().init_forward_pre_hook(bagua_ddp)

        def hook(inputs) -> None:
            # read on the training thread, where GradScaler.update() wrote it (a device sync on CUDA, once a step);
            # the bucket operations may run on the communication thread
            self._scale = float(self.grad_scaler.get_scale())

        return hook

    def init_post_backward_hook(self, bagua_ddp):
        def hook() -> None:
            bagua_ddp.launch_remaining_buckets()
            bagua_ddp.wait_pending_comm_ops()
            check_finite_after_communication(bagua_ddp, self.nonfinite, "ByteGrad", self._verdicts.take())

        return hook

    def tensors_to_buckets(self, tensors, do_flatten: bool) -> list[BaguaBucket]:
        # the chunk codec: padded to the group size so that every bucket splits into one equal chunk per rank
        alignment = self.process_group.get_global_communicator().nranks() if self.codec == "chunk" else 1
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
            codec=self.codec,
            block_size=self.block_size,
            grad_scale=None if self.grad_scaler is None else (lambda: self._scale),
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
        codec: a gradient codec of the codec registry (:mod:`~bagua.torch_api.codecs.registry`; an alias such as
            ``"MinMaxUInt8"`` gives the same codec): ``"chunk"`` (the default: one min/max per rank chunk, the
            original's code), ``"uint8"`` (one min/max
            per block of ``block_size`` elements: every tensor keeps its resolution, for 8 bytes per block more) or
            ``"uint4"`` (block-wise, 4 bits per value: half the bytes of ``"uint8"``, for very slow links; coarser,
            pair it with ``error_feedback=True``). See the module docstring for the bounds.
        block_size: elements per block of ``"uint8"``/``"uint4"`` (even; default
            :data:`~bagua.torch_api.codecs.block.DEFAULT_BLOCK`).
        grad_scaler: the ``torch.amp.GradScaler`` scaling the loss, with error feedback: the residuals follow its
            scale changes (module docstring). Not needed otherwise.
        fault_tolerance: a :class:`~bagua.torch_api.fault.replica.FaultTolerance`: this process is one worker of
            a job whose workers fail alone; each step's gradients are encoded once with ``codec`` (a block codec:
            ``"uint8"`` or ``"uint4"``), all-gathered over that step's live workers and averaged
            (docs/fault_tolerance.md, "Synchronous jobs"); non-finite contributions are left out of the round.

    Example:
        >>> from bagua.torch_api.algorithms import bytegrad
        >>> model = model.with_bagua([optimizer], bytegrad.ByteGradAlgorithm())  # doctest: +SKIP
        >>> algorithm = bytegrad.ByteGradAlgorithm(codec="uint8", error_feedback=True)
    """

    replica_hook: ClassVar[Optional[str]] = "bytegrad"

    hierarchical: bool = True
    average: bool = True
    error_feedback: bool = False
    nonfinite: str = "propagate"
    codec: str = "chunk"
    block_size: int = DEFAULT_BLOCK
    grad_scaler: Optional[Any] = None
    fault_tolerance: Optional[FaultTolerance] = None

    def __post_init__(self) -> None:
        for name in ("hierarchical", "average", "error_feedback"):
            check_bool("ByteGradAlgorithm", name, getattr(self, name))
        check_choice("ByteGradAlgorithm", "nonfinite", self.nonfinite, NONFINITE_POLICIES)
        self.codec = check_codec("ByteGradAlgorithm", self.codec, self.block_size)  # an alias becomes its name
        if self.grad_scaler is not None and not callable(getattr(self.grad_scaler, "get_scale", None)):
            raise ValueError(f"ByteGradAlgorithm(grad_scaler=...) must be a torch.amp.GradScaler (something with "
                             f"get_scale()), got {type(self.grad_scaler).__name__}")
        if self.grad_scaler is not None and not self.error_feedback:
            warnings.warn("ByteGradAlgorithm(grad_scaler=...) only rescales error-feedback residuals; without "
                          "error_feedback=True it does nothing (GradScaler works without it)", stacklevel=3)
        if self.fault_tolerance is not None:
            check_fault_tolerance("ByteGradAlgorithm", self.fault_tolerance, self.average)
            if GlobalCodecRegistry.get(self.codec).block_codec is None:
                raise ValueError(f"ByteGradAlgorithm(fault_tolerance=..., codec={self.codec!r}): the live workers' "
                                 "gradients are all-gathered, which needs a block codec; pass codec='uint8' (8 "
                                 "bits, one min/max per block) or codec='uint4'")
            if self.nonfinite != "propagate":
                raise ValueError(f"ByteGradAlgorithm(fault_tolerance=..., nonfinite={self.nonfinite!r}): under fault "
                                 "tolerance a contribution that is not finite is left out of the step's round (and "
                                 "its worker named in the log); leave nonfinite at its default")
            if self.grad_scaler is not None:
                raise ValueError("ByteGradAlgorithm(fault_tolerance=..., grad_scaler=...) is not supported yet: "
                                 "a step over the live workers leaves non-finite contributions out instead; drop "
                                 "grad_scaler (or use bf16 autocast, which needs no scaler)")

    def reify(self, process_group: BaguaProcessGroup) -> "ByteGradAlgorithmImpl | FaultTolerantStepsImpl":
        if self.fault_tolerance is not None:
            return FaultTolerantStepsImpl(process_group, self.fault_tolerance, "ByteGradAlgorithm",
                                          codec=self.codec, block_size=self.block_size,
                                          error_feedback=self.error_feedback)
        hyper = {k: v for k, v in self.hyperparameters().items() if k != "fault_tolerance"}
        return ByteGradAlgorithmImpl(process_group, **hyper)
