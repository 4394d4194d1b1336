"""Error-feedback residuals of a compressed allreduce's workspace: undone after a step that was not finite, rescaled
when the gradients' scale changes (a ``GradScaler``'s ``update()``).

Both workspaces (:class:`~bagua.torch_api.codecs.compressed_allreduce.Workspace`, ByteGrad's per-chunk code, and
:class:`~bagua.torch_api.codecs.block_allreduce.BlockWorkspace`, the block codecs) keep ``residual`` (this rank's
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
    >>> sorted(w.state_dict())
    ['residual', 'server_residual']
    >>> _ = w.residual.fill_(1.0); w.follow_scale(1024.0); w.follow_scale(512.0); w.residual.tolist()
    [0.5, 0.5]
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["ErrorFeedbackResiduals"]


class ErrorFeedbackResiduals:
    """``rollback``, ``scale_residuals``, ``follow_scale`` and ``state_dict`` of a workspace with ``residual``,
    ``server_residual`` and ``previous`` attributes (see the module docstring)."""

    __slots__ = ("residual_scale",)  # the gradients' scale the residuals are in units of (unset: not known yet)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The error-feedback residuals (``residual``, ``server_residual``), copied; empty without them."""
        if self.residual is None:
            return {}
        return {"residual": self.residual.clone(), "server_residual": self.server_residual.clone()}

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

    def follow_scale(self, scale: Optional[float]) -> None:
        """Keep the residuals in the units of this call's gradients, scaled by ``scale`` (the loss scaler's
        ``get_scale()``, read on the training thread): multiplied by ``scale / old`` when the scale changed since
        the last call. ``None`` (no scaler) does nothing."""
        if scale is None:
            return
        old = getattr(self, "residual_scale", None)
        if old is not None and scale != old:
            self.scale_residuals(scale / old)
        self.residual_scale = scale
