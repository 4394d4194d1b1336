"""The original's shorter import path of :mod:`bagua.torch_api.model_parallel.moe`.

Example:
    >>> from bagua.torch_api.moe import MoE
"""

from __future__ import annotations

from bagua.torch_api.model_parallel.moe import Experts, MOELayer, MoE, TopKGate, top1gating, top2gating

__all__ = ["MoE", "MOELayer", "Experts", "TopKGate", "top1gating", "top2gating"]
