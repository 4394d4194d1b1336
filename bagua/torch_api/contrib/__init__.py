"""Optional pieces around the engine: fused optimizer, load-balanced samplers, cached dataset, sync batchnorm, and
Bagua for plain torch DDP (``ddp_hooks``: ByteGrad as a DDP comm hook; ``DiLoCoOptimizer``).

Names are imported lazily so that ``import bagua.torch_api`` never needs the optional extras (``lmdb``,
``redis``) installed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "fuse_optimizer",
    "is_fused_optimizer",
    "LoadBalancingDistributedSampler",
    "LoadBalancingDistributedBatchSampler",
    "CacheLoader",
    "CachedDataset",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "DiLoCoOptimizer",
]

_LAZY = {
    "fuse_optimizer": "bagua.torch_api.contrib.fuse.optimizer",
    "is_fused_optimizer": "bagua.torch_api.contrib.fuse.optimizer",
    "LoadBalancingDistributedSampler": "bagua.torch_api.contrib.load_balancing_data_loader",
    "LoadBalancingDistributedBatchSampler": "bagua.torch_api.contrib.load_balancing_data_loader",
    "CacheLoader": "bagua.torch_api.contrib.cache_loader",
    "CachedDataset": "bagua.torch_api.contrib.cached_dataset",
    "SyncBatchNorm": "bagua.torch_api.contrib.sync_batchnorm",
    "convert_sync_batchnorm": "bagua.torch_api.contrib.sync_batchnorm",
    "DiLoCoOptimizer": "bagua.torch_api.contrib.diloco_optimizer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'bagua.torch_api.contrib' has no attribute {name!r}")
