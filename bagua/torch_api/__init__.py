"""Bagua's PyTorch API, importable as ``import bagua.torch_api as bagua``.

Example:
    >>> import bagua.torch_api as bagua
    >>> from bagua.torch_api.algorithms import gradient_allreduce
    >>> bagua.init_process_group()  # doctest: +SKIP
    >>> model = model.with_bagua([optimizer], gradient_allreduce.GradientAllReduceAlgorithm())  # doctest: +SKIP
"""

from __future__ import annotations

from bagua.torch_api import _log, algorithms, checkpoint, communication, contrib, data_parallel, env, moe, utils
from bagua.torch_api.comm import collectives as _collectives
from bagua.torch_api.comm.collectives import *  # noqa: F403 - the collectives, named once in collectives.__all__
from bagua.torch_api.communication import ReduceOp, get_backend, init_process_group
from bagua.torch_api.distributed import BaguaModule
from bagua.torch_api.env import get_local_rank, get_local_size, get_node_rank, get_rank, get_world_size
from bagua.torch_api.tensor import BaguaTensor

__all__ = [
    "get_backend", "init_process_group", *_collectives.__all__, "ReduceOp", "BaguaModule", "BaguaTensor",
    "get_local_rank", "get_local_size", "get_node_rank", "get_rank", "get_world_size",
    "algorithms", "checkpoint", "communication", "contrib", "data_parallel", "env", "moe", "utils",
]

_log.configure()  # the "bagua" logger: level from BAGUA_LOG_LEVEL, records prefixed with the rank
