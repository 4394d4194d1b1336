"""Generic fused optimizer: step any elementwise ``torch.optim.Optimizer`` on a few flat tensors.

Example:
    >>> from bagua.torch_api.contrib.fuse import fuse_optimizer
    >>> opt = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP
    >>> opt.fuse_step()  # doctest: +SKIP
"""

from __future__ import annotations

from bagua.torch_api.contrib.fuse.optimizer import fuse_optimizer, fuse_step, is_fused_optimizer

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer"]
