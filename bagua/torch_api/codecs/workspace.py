"""The compressed collective of every codec: one factory for its workspaces, and its two patterns.

- **Scatter-reduce-gather** (:func:`compressed_allreduce_inplace`): each rank encodes one chunk per peer, the
  chunk's owner decodes, sums and re-encodes it, and the reduced chunks are all-gathered; every element is
  quantized twice and a rank sends ``2 (n-1) / n`` of the encoded tensor. ByteGrad, QAdam, the DDP hook and
  DiLoCo over ranks. Each workspace runs its own code's schedule (``workspace.allreduce_inplace``), so callers do
  not branch on the codec.
- **All-gather** (:func:`allgather_average`): each member encodes its tensor once, the wires are all-gathered and
  every member decodes and sums them in member order; nothing is re-quantized, so a round that fails leaves
  nothing half-reduced (fault-tolerant rounds, where the membership is a quorum's and contributions are weighted).

The bucket operation of ByteGrad (:func:`~bagua.torch_api.ops.compressed.centralized_low_precision_op`), the DDP
hook (:class:`~bagua.torch_api.contrib.ddp_hooks.ByteGradState`) and DiLoCo's drivers keep a workspace per bucket
or fragment: :func:`make_workspace` builds it for a codec name (through the codec registry,
:mod:`~bagua.torch_api.codecs.registry`). Both workspace types share the rest of their interface: ``device``,
``bytes_sent()``, ``state_dict()`` / ``load_state_dict()``, ``rollback()``, ``follow_scale()``.

Example:
    >>> ws = make_workspace("uint4", 10_000, 2)
    >>> type(ws).__name__, ws.bytes_sent()
    ('BlockWorkspace', 8224)
    >>> type(make_workspace("chunk", 10_000, 2, torch.device("cpu"))).__name__
    'Workspace'
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from bagua.torch_api.codecs.block import DEFAULT_BLOCK
from bagua.torch_api.codecs.block_allreduce import BlockWorkspace, allgather_decode
from bagua.torch_api.codecs.compressed_allreduce import Workspace
from bagua.torch_api.codecs.registry import GlobalCodecRegistry
from bagua.torch_api.comm.process_group import BaguaCommunicator

__all__ = ["AnyWorkspace", "make_workspace", "compressed_allreduce_inplace", "allgather_average"]

#: Either workspace: MinMaxUInt8 per rank chunk (``"chunk"``) or block-wise (``"bf16"``, ``"uint8"``, ``"uint4"``).
AnyWorkspace = Union[Workspace, BlockWorkspace]


def make_workspace(
    codec: str,
    numel: int,
    nranks: int,
    device: Optional[torch.device] = None,
    block_size: int = DEFAULT_BLOCK,
    error_feedback: bool = False,
    keep_previous: Optional[bool] = None,
) -> AnyWorkspace:
    """Build the workspace of one tensor's compressed allreduce with ``codec``.

    Args:
        codec: a name (or alias) of :data:`~bagua.torch_api.codecs.registry.GlobalCodecRegistry`: ``"chunk"``
            (MinMaxUInt8, one min/max per rank chunk), ``"bf16"``, ``"uint8"``, ``"uint4"`` or ``"nf2"``.
        numel: elements of the flat tensor.
        nranks: ranks of the communicator.
        device: the tensor's device; required by ``"chunk"``, which allocates its buffers now (the block codecs
            allocate theirs at the first call).
        block_size: elements per block of the block codecs.
        error_feedback: the chunk code allocates its residuals now; for the block codecs, the default of
            ``keep_previous``.
        keep_previous: block codecs: keep the residuals from before each call, for ``rollback`` (``None``: as
            ``error_feedback``); the chunk code always keeps them with error feedback.

    Returns:
        A :class:`~bagua.torch_api.codecs.compressed_allreduce.Workspace` or a
        :class:`~bagua.torch_api.codecs.block_allreduce.BlockWorkspace`.

    Example:
        >>> make_workspace("uint8", 100, 2, error_feedback=True).keep_previous
        True
    """
    return GlobalCodecRegistry.get(codec).workspace(numel, nranks, device, block_size, error_feedback, keep_previous)


def compressed_allreduce_inplace(flat: torch.Tensor, workspace: AnyWorkspace, c: BaguaCommunicator, *,
                                 average: bool = True, error_feedback: bool = False, tag: int = 0,
                                 source: Optional[Callable[[int, int], list[torch.Tensor]]] = None) -> Optional[bool]:
    """Average (or sum) ``flat`` over ``c`` in place with the codec ``workspace`` was made for.

    Args:
        flat: a 1-D float tensor, the same size on every rank (the block codecs compute on a float32 copy of
            another dtype and copy the result back).
        workspace: from :func:`make_workspace`, kept from call to call (its residuals live there).
        c: the communicator.
        average: divide the sum by the number of ranks.
        error_feedback: carry the quantization errors to the next call; the chunk code's workspace decides at
            creation, and this must agree with it.
        tag: the point-to-point tag.
        source: chunk code only: where to read the input (see
            :func:`~bagua.torch_api.codecs.compressed_allreduce.low_precision_allreduce_inplace`).

    Returns:
        The chunk code: whether the result is finite, read from its headers (``None`` when nothing was
        communicated). The block codecs: ``None``; read the result (a block holding a NaN or an Inf decodes to NaN
        on every rank), e.g. with :func:`~bagua.torch_api.codecs.compressed_allreduce.all_finite`.

    Example:
        >>> ws = make_workspace("uint4", grad.numel(), c.nranks(), error_feedback=True)  # doctest: +SKIP
        >>> compressed_allreduce_inplace(grad, ws, c, error_feedback=True)  # doctest: +SKIP
    """
    return workspace.allreduce_inplace(flat, c, average=average, error_feedback=error_feedback, tag=tag, source=source)


def allgather_average(x: torch.Tensor, codec: str, all_gather: Callable[[torch.Tensor], Optional[list[torch.Tensor]]],
                      block_size: int = DEFAULT_BLOCK, weights: Optional[Sequence[float]] = None,
                      ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Average the members' ``x`` by the all-gather pattern: encode once, all-gather, decode-sum in member order.

    Every member decodes the same wires in the same order, so every member ends with the same average, bit for bit.

    Args:
        x: this member's 1-D float32 tensor (its error-feedback residual already added, if any); not modified.
        codec: a block codec of the registry (``"bf16"``, ``"uint8"``, ``"uint4"``, ``"nf2"``, or an alias).
        all_gather: ``all_gather(wire)`` returns every member's wire in member order, or ``None`` when the round
            failed (a fault-tolerant round records rather than raises).
        block_size: the codec's block size.
        weights: each member's weight, in member order (e.g. the samples it contributed; 0 adds nothing); ``None``
            for equal weights: the sum of the decoded wires divided by their number.

    Returns:
        ``(average, wire)`` (this member's own wire, to compute its residual ``x - decode(wire)``), or ``None``
        when ``all_gather`` returned ``None``.

    Example:
        >>> x = torch.tensor([1.0, 3.0])
        >>> allgather_average(x, "bf16", lambda wire: [wire, wire])[0]
        tensor([1., 3.])
    """
    spec = GlobalCodecRegistry.get(codec)
    if spec.block_codec is None:
        raise ValueError(f"the all-gather pattern takes a block codec, not {codec!r}; available: "
                         + ", ".join(repr(n) for n in GlobalCodecRegistry if GlobalCodecRegistry[n].block_codec))
    return allgather_decode(x, spec.block_codec, all_gather, block_size, weights)
