"""The data-parallel engine and the DDP-style wrapper."""

from bagua.torch_api.data_parallel.bagua_distributed import BaguaDistributedDataParallel
from bagua.torch_api.data_parallel.distributed import DistributedDataParallel

__all__ = ["BaguaDistributedDataParallel", "DistributedDataParallel"]
