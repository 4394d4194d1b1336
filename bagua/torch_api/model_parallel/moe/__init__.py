"""Expert-parallel mixture of experts: :class:`MoE` and its parts.

Example:
    >>> from bagua.torch_api.model_parallel.moe import MoE
"""

from __future__ import annotations

from bagua.torch_api.model_parallel.moe.gating import TopKGate, top1gating, top2gating
from bagua.torch_api.model_parallel.moe.layer import MOELayer, Experts, MoE

__all__ = ["MoE", "MOELayer", "Experts", "TopKGate", "top1gating", "top2gating"]
