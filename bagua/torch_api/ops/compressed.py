"""The bucket operation of ByteGrad and QAdam's compressed stage: a compressed allreduce per bucket, by codec.

ByteGrad = a codec around a scatter-reduce-gather allreduce. The codec picks the collective:

- ``"chunk"``: MinMaxUInt8 with one min/max per rank chunk (the original's; bit-identical to it),
  :func:`~bagua.torch_api.codecs.compressed_allreduce.low_precision_allreduce_inplace`;
- ``"uint8"`` / ``"uint4"``: one min/max per block of ``block_size`` elements, 8 or 4 bits per value
  (:mod:`bagua.torch_api.codecs.block`, bound :func:`~bagua.torch_api.codecs.block.error_bound`),
  :func:`~bagua.torch_api.codecs.block_allreduce.block_allreduce_inplace`.

Both quantize every element twice (at its rank, then at its chunk's owner), leave identical bytes on every rank,
carry their quantization errors to the next step with error feedback (residuals that a non-finite step rolls back,
saved and restored with :class:`CentralizedLowPrecisionOp`'s ``state_dict``), and run hierarchically (float32
inside a node, the codec among node leaders) through :func:`bagua.torch_api.comm.hierarchy.run_hierarchically`.

Example:
    >>> op = centralized_low_precision_op(group, hierarchical=False, codec="uint8")  # doctest: +SKIP
    >>> bucket.append_op(op)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from bagua.torch_api.comm import hierarchy
from bagua.torch_api.codecs.block import DEFAULT_BLOCK
from bagua.torch_api.codecs.compressed_allreduce import Workspace, all_finite, bucket_tag
from bagua.torch_api.codecs.registry import GlobalCodecRegistry
from bagua.torch_api.codecs.workspace import AnyWorkspace, compressed_allreduce_inplace, make_workspace
from bagua.torch_api.comm.process_group import BaguaCommunicator, BaguaProcessGroup
from bagua.torch_api.ops.base import BucketOp
from bagua.torch_api.interfaces import Bucket

__all__ = ["CODECS", "CentralizedLowPrecisionOp", "check_codec", "centralized_low_precision_op"]

#: The codecs of :func:`centralized_low_precision_op`, those of the codec registry offered for gradients
#: (:mod:`~bagua.torch_api.codecs.registry`): ``"chunk"`` (MinMaxUInt8 with one min/max per rank chunk, the
#: original's, :mod:`~bagua.torch_api.codecs.compressed_allreduce`) and the block-wise ``"uint8"`` and ``"uint4"``
#: of :mod:`~bagua.torch_api.codecs.block` (one min/max per block of ``block_size`` elements, through
#: :func:`~bagua.torch_api.codecs.block_allreduce.block_allreduce_inplace`).
CODECS = tuple(GlobalCodecRegistry.available(for_gradients=True))


def check_codec(owner: str, codec: object, block_size: object, for_gradients: bool = True) -> str:
    """Return the registered name of the gradient codec ``codec`` (an alias such as ``"MinMaxUInt8"`` gives
    ``"chunk"``); raise ``ValueError`` unless it is one of :data:`CODECS` (any codec of the registry with
    ``for_gradients=False``) and ``block_size`` a positive even integer.

    Example:
        >>> check_codec("ByteGradAlgorithm", "uint8", 4096), check_codec("ByteGradAlgorithm", "MinMaxUInt8", 4096)
        ('uint8', 'chunk')
    """
    try:
        name = GlobalCodecRegistry.get(codec, for_gradients=for_gradients).name  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(f"{owner}(codec={codec!r}) is not a codec; "
                         f"available: {GlobalCodecRegistry.listing(for_gradients=for_gradients, near=codec)}") from None
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"{owner}(block_size={block_size!r}) must be a positive even integer, elements per block of "
                         f"the 'uint8'/'uint4' codecs (default {DEFAULT_BLOCK})")
    return name


class CentralizedLowPrecisionOp(BucketOp):
    """The bucket operation of ByteGrad (and of QAdam's compressed stage): ``op(bucket, flat)``.

    Flat: the compressed allreduce over the group (see the module docstring for which, by ``codec``). Hierarchical
    (when the group spans several nodes of several ranks): float32 reduce to each node's leader, the compressed
    allreduce among the leaders, broadcast inside each node. The buffers (and error-feedback residuals) of each
    bucket live in this op and are reused every step; :meth:`rollback`, :meth:`state_dict` and
    :meth:`load_state_dict` act on the residuals, :meth:`reset` drops buffers and residuals.

    Args:
        group: the process group.
        hierarchical: communicate hierarchically when the group's layout allows it.
        average: average (True) or sum (False).
        error_feedback: carry each rank's quantization error to the next step (EF-SGD; see
            :mod:`bagua.torch_api.algorithms.bytegrad`).
        on_finite: called as ``on_finite(bucket.name, finite)`` after each run, ``finite`` telling whether the
            bucket's result holds only finite values (read from the 8-bit headers where possible, see
            :meth:`~bagua.torch_api.codecs.minmax_uint8.ChunkParams.decodes_finite`). Every rank decodes the same bytes,
            so every rank reaches the same verdict.
        codec: one of :data:`CODECS`, or an alias of one (``"MinMaxUInt8"``).
        block_size: elements per block of the block-wise codecs.
        grad_scale: with error feedback, returns the scale of this step's gradients (``GradScaler.get_scale()``,
            read on the training thread); when it changes, the residuals (kept in units of scaled gradients) are
            multiplied by ``new_scale / old_scale`` before the exchange.
    """

    # the flat exchange of the chunk codec reads fresh gradients in place (see BaguaBucket.defer_restore)
    accepts_pending = True

    def __init__(self, group: BaguaProcessGroup, hierarchical: bool = False, average: bool = True,
                 error_feedback: bool = False, on_finite: Optional[Callable[[str, bool], None]] = None,
                 codec: str = "chunk", block_size: int = DEFAULT_BLOCK,
                 grad_scale: Optional[Callable[[], float]] = None) -> None:
        codec = check_codec("centralized_low_precision_op", codec, block_size)
        self.group, self.hierarchical, self.average = group, hierarchical, average
        self.error_feedback, self.on_finite, self.grad_scale = error_feedback, on_finite, grad_scale
        self.codec, self.block_size = codec, block_size
        self._workspaces: dict[tuple, AnyWorkspace] = {}
        self._loaded: dict[str, torch.Tensor] = {}  # residuals from a checkpoint, for workspaces not yet built

    def _workspace_for(self, bucket: Bucket, flat: torch.Tensor, c: BaguaCommunicator) -> AnyWorkspace:
        key = (bucket.name, flat.numel(), flat.dtype, flat.device, tuple(c.ranks))
        ws = self._workspaces.get(key)
        if ws is None:
            # a bucket rebuilt with another size: its old buffers (and residuals) cannot be reused
            for stale in [k for k in self._workspaces if k[0] == bucket.name]:
                del self._workspaces[stale]
            ws = make_workspace(self.codec, flat.numel(), c.nranks(), flat.device, self.block_size,
                                self.error_feedback)
            self._workspaces[key] = ws
            self._load_residuals(ws)
        return ws

    def __call__(self, bucket: Bucket, flat: torch.Tensor) -> None:
        group = self.group
        verdict: list[Optional[bool]] = [None]
        tag = bucket_tag(bucket, group)
        flat_mode = not hierarchy.is_hierarchical(group, self.hierarchical)
        if (self.codec != "chunk" or not flat_mode or not group.get_global_communicator().is_member()
                or group.size() == 1):
            bucket.materialize_pending()  # only the flat exchange of the chunk codec reads fresh gradients in place
        # read on the training thread
        scale = self.grad_scale() if self.grad_scale is not None and self.error_feedback else None

        def exchange(t: torch.Tensor, c: BaguaCommunicator) -> None:
            verdict[0] = self._exchange(bucket, t, c, scale, flat_mode, tag)

        hierarchy.run_hierarchically(group, self.hierarchical, flat, exchange, self.average)
        # hierarchically only the leaders see the 8-bit headers: every rank then checks the broadcast result
        finite = verdict[0] if flat_mode else None
        if bucket.padding:
            flat[bucket.numel :].zero_()  # the padding takes part in min/max: keep it zero, as in the maths
        if self.on_finite is not None:
            self.on_finite(bucket.name, all_finite(flat) if finite is None else finite)

    def _exchange(self, bucket: Bucket, t: torch.Tensor, c: BaguaCommunicator, scale: Optional[float],
                  flat_mode: bool, tag: int) -> Optional[bool]:
        """Allreduce ``t`` over ``c`` with the codec; return the chunk codec's finite verdict (else ``None``)."""
        ws = self._workspace_for(bucket, t, c)
        ws.follow_scale(scale)
        # the chunk codec reads gradients not yet copied into the bucket where they are (no copy of the bucket);
        # the block codecs' verdict is read from the result (a block holding NaN/Inf decodes to NaN on every rank)
        direct = (isinstance(ws, Workspace) and flat_mode and bucket.has_pending() and ws.staging is None
                  and ws.residual is None)
        if not direct:
            bucket.materialize_pending()
        return compressed_allreduce_inplace(t, ws, c, average=self.average, error_feedback=self.error_feedback,
                                            tag=tag, source=bucket.pieces if direct else None)

    def reset(self) -> None:
        """Drop every bucket's buffers and residuals."""
        self._workspaces.clear()

    def rollback(self) -> None:
        """Give the residuals their values from before the last call."""
        for ws in self._workspaces.values():
            ws.rollback()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residuals (``residual``, ``server_residual``); empty without them."""
        state = dict(self._loaded)
        for ws in self._workspaces.values():
            state = ws.state_dict() or state
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the residuals of :meth:`state_dict` (into the buffers now, or once they are built)."""
        self._loaded.clear()
        self._loaded.update(state)
        for ws in self._workspaces.values():
            self._load_residuals(ws)

    def _load_residuals(self, ws: AnyWorkspace) -> None:
        if self.error_feedback and self._loaded:
            ws.load_state_dict(self._loaded)  # checks the shapes
            self._loaded.clear()


#: The original's name of the operation's constructor (``bucket.append_op(centralized_low_precision_op(group))``).
centralized_low_precision_op = CentralizedLowPrecisionOp
