"""One factory for the compressed allreduces' workspaces, and one allreduce that runs whichever codec it was made for.

The bucket operation of ByteGrad (:func:`~bagua.torch_api.ops.compressed.centralized_low_precision_op`), the DDP
hook (:class:`~bagua.torch_api.contrib.ddp_hooks.ByteGradState`) and DiLoCo's drivers keep a workspace per bucket
or fragment: :func:`make_workspace` builds it for a codec name (through the codec registry,
:mod:`~bagua.torch_api.codecs.registry`), and :func:`compressed_allreduce_inplace` runs the
collective of its type, so that callers do not branch on the codec. Both workspace types share the rest of their
interface: ``device``, ``bytes_sent()``, ``state_dict()`` / ``load_state_dict()``, ``rollback()``,
``follow_scale()``.

Example:
    >>> ws = make_workspace("uint4", 10_000, 2)
    >>> type(ws).__name__, ws.bytes_sent()
    ('BlockWorkspace', 8224)
    >>> type(make_workspace("chunk", 10_000, 2, torch.device("cpu"))).__name__
    'Workspace'
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from bagua.torch_api.codecs.block import DEFAULT_BLOCK
from bagua.torch_api.codecs.block_allreduce import BlockWorkspace, block_allreduce_inplace
from bagua.torch_api.codecs.compressed_allreduce import Workspace, low_precision_allreduce_inplace
from bagua.torch_api.codecs.registry import GlobalCodecRegistry
from bagua.torch_api.comm.process_group import BaguaCommunicator

__all__ = ["AnyWorkspace", "make_workspace", "compressed_allreduce_inplace"]

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
    if isinstance(workspace, BlockWorkspace):
        if source is not None:
            raise ValueError("source= reads the input in pieces for the 'chunk' codec only")
        x = flat if flat.dtype == torch.float32 else flat.float()
        block_allreduce_inplace(x, c, workspace.codec, workspace.block_size, average, workspace, error_feedback, tag)
        if x is not flat:
            flat.copy_(x)
        return None
    if error_feedback != (workspace.residual is not None):
        raise ValueError(f"error_feedback={error_feedback}, but the workspace was built with"
                         f"{'' if workspace.residual is not None else 'out'} error feedback")
    return low_precision_allreduce_inplace(flat, c, average, workspace, source=source, tag=tag)
