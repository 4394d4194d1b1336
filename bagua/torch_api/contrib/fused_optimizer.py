"""The original's import path of the fused optimizer; the code lives in :mod:`bagua.torch_api.contrib.fuse`.

Example:
    >>> from bagua.torch_api.contrib.fused_optimizer import fuse_optimizer
"""

from __future__ import annotations

from bagua.torch_api.contrib.fuse.optimizer import calculate_mutual_groups, fuse_optimizer, fuse_step, is_fused_optimizer

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer", "calculate_mutual_groups"]
