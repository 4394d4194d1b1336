"""Segment: the record of one segment's flat buffers and the objects expected to be views of them.

The word *segment* is defined in :mod:`bagua.torch_api.contrib.fuse.layout`, which builds segments and re-exports
this class; :mod:`bagua.torch_api.contrib.fuse.grads` copies gradients into them. Both import this module, which
imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional

import torch

__all__ = ["Segment"]


@dataclass(eq=False)
class Segment:
    """Parameters of one group, dtype and device that share flat buffers at the same offsets.

    Fields, grouped:
        layout: ``params``, ``offsets`` (``len(params) + 1`` element offsets), ``owned``, ``flat_param``,
        ``flat_grad``, ``flat_state``, ``scalar_state``.
        expected objects (checked by identity every step): ``grad_views``, ``param_ptrs``, ``state_views``,
        ``scalar_views``; ``installed[i]`` says whether ``params[i].grad`` was ever pointed at the flat gradient,
        ``grad_ids[i]`` is the ``id`` of the gradient last copied in without being re-pointed (see
        :func:`install_grads`).
        copying all gradients in: ``copy_ranges`` (see :func:`copy_ranges`).
        per-parameter verdict: ``eligible[i]`` is False when the parameter's state cannot live in the flat
        buffers (state of another shape, dtype or device); such parameters are stepped on their own.
    """

    params: list[torch.Tensor]
    offsets: list[int]
    owned: bool
    flat_param: torch.Tensor
    flat_grad: torch.Tensor
    flat_state: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    scalar_state: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    grad_views: list[torch.Tensor] = field(default_factory=list)
    param_ptrs: list[int] = field(default_factory=list)
    state_views: dict[Hashable, list[Optional[torch.Tensor]]] = field(default_factory=dict)
    scalar_views: dict[Hashable, list[Optional[torch.Tensor]]] = field(default_factory=dict)
    installed: list[bool] = field(default_factory=list)
    grad_ids: list[int] = field(default_factory=list)
    copy_ranges: list[tuple[int, int, Optional[torch.Tensor]]] = field(default_factory=list)
    eligible: list[bool] = field(default_factory=list)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Return the view of ``flat`` that belongs to ``params[i]``, shaped like it."""
        a, b = self.offsets[i], self.offsets[i + 1]
        return flat[a:b].view(self.params[i].shape)
