"""Error-feedback residuals of a compressed allreduce's workspace: undone after a step that was not finite, rescaled
when the gradients' scale changes.

Both workspaces (:class:`~bagua.torch_api.compressed_allreduce.Workspace`, ByteGrad's per-chunk code, and
:class:`~bagua.torch_api.block_allreduce.BlockWorkspace`, the block codecs) keep ``residual`` (this rank's
quantization error), ``server_residual`` (its chunk's, as the chunk's owner) and ``previous`` (both as they were
before the last call, or ``None`` where nothing can be undone).

Example:
    >>> import torch
    >>> class W(ErrorFeedbackResiduals):
    ...     def __init__(self):
    ...         self.residual, self.server_residual = torch.ones(2), torch.ones(1)
    ...         self.previous = (torch.zeros(2), torch.zeros(1))
    >>> w = W(); w.scale_residuals(0.5); w.residual.tolist()
    [0.5, 0.5]
    >>> w.rollback(); w.residual.tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

__all__ = ["ErrorFeedbackResiduals"]


class ErrorFeedbackResiduals:
    """``rollback`` and ``scale_residuals`` of a workspace with ``residual``, ``server_residual`` and
    ``previous`` attributes (see the module docstring)."""

    __slots__ = ()

    def rollback(self) -> None:
        """Give the residuals back their values from before the last call (a step that was not finite); a no-op
        without error feedback or without a kept copy (``previous is None``)."""
        if self.previous is not None and self.residual is not None:
            self.residual.copy_(self.previous[0])
            self.server_residual.copy_(self.previous[1])

    def scale_residuals(self, factor: float) -> None:
        """Multiply the residuals by ``factor`` (the gradients' scale changed: ``new_scale / old_scale``)."""
        if self.residual is not None:
            self.residual.mul_(factor)
            self.server_residual.mul_(factor)
