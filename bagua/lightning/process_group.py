"""The pieces of :mod:`bagua.lightning.strategy` that need no strategy object: Lightning's reduce op in Bagua's
terms, the process group of a Lightning job, the early check of ``BaguaStrategy``'s arguments and the broadcast of
rank 0's module state. This module does not import Lightning.

Example:
    >>> from bagua.lightning.process_group import to_bagua_reduce_op
    >>> to_bagua_reduce_op(None).name
    'SUM'
"""

from __future__ import annotations

import datetime
import inspect
import itertools
from typing import Any, Union

import torch
import torch.distributed as dist

import bagua.torch_api as bagua
from bagua.torch_api import communication as comm
from bagua.torch_api.algorithms import Algorithm, GlobalAlgorithmRegistry
from bagua.torch_api.communication import ReduceOp

__all__ = ["to_bagua_reduce_op", "init_bagua_process_group", "check_algorithm_arguments", "broadcast_module_state",
           "QADAM_OPTIMIZER_KWARG"]

#: The keyword through which the strategy hands QAdam its optimizer.
QADAM_OPTIMIZER_KWARG = "q_adam_optimizer"
_REDUCE_OPS = {
    "sum": ReduceOp.SUM,
    "mean": ReduceOp.AVG,
    "avg": ReduceOp.AVG,
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
    "product": ReduceOp.PRODUCT,
    "band": ReduceOp.BAND,
    "bor": ReduceOp.BOR,
    "bxor": ReduceOp.BXOR,
}


def to_bagua_reduce_op(reduce_op: Union[str, ReduceOp, dist.ReduceOp, None]) -> ReduceOp:
    """Translate Lightning's ``reduce_op`` (a name, a ``torch.distributed.ReduceOp`` or ``None`` = sum).

    Example:
        >>> to_bagua_reduce_op("mean")
        <ReduceOp.AVG: 10>
    """
    if reduce_op is None:
        return ReduceOp.SUM
    if isinstance(reduce_op, ReduceOp):
        return reduce_op
    if isinstance(reduce_op, str):
        if reduce_op.lower() not in _REDUCE_OPS:
            raise ValueError(f"unknown reduce_op {reduce_op!r}; use one of {sorted(_REDUCE_OPS)}")
        return _REDUCE_OPS[reduce_op.lower()]
    for op in ReduceOp:
        if hasattr(dist.ReduceOp, op.name) and reduce_op == getattr(dist.ReduceOp, op.name):
            return op
    raise ValueError(f"unsupported reduce_op {reduce_op!r}; use one of {sorted(_REDUCE_OPS)}")


def init_bagua_process_group(
    main_address: str,
    main_port: int,
    backend: str,
    rank: int,
    world_size: int,
    local_world_size: int,
    timeout: datetime.timedelta,
) -> None:
    """Initialize ``torch.distributed`` (unless already done) and Bagua's default group for a Lightning job.

    The rendezvous is a TCP store at ``main_address:main_port`` (under ``torchrun`` the agent's store, as
    ``torch.distributed.rendezvous`` knows). ``backend`` is Lightning's choice for the root device, so a CPU
    Trainer on a GPU machine still communicates with gloo.

    Args:
        main_address: host of rank 0.
        main_port: port of the rendezvous store.
        backend: ``"gloo"`` or ``"nccl"``.
        rank: global rank of this process.
        world_size: number of processes.
        local_world_size: processes per node (exported as ``LOCAL_WORLD_SIZE``, which Bagua's hierarchical
            algorithms use).
        timeout: limit of every collective.
    """
    if dist.is_initialized():
        bagua.init_process_group()
        return
    url = f"tcp://{main_address}:{main_port}"
    store, _, _ = next(dist.rendezvous(url, rank=rank, world_size=world_size, timeout=timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    bagua.init_process_group(store=store, rank=rank, world_size=world_size, local_world_size=local_world_size)


def check_algorithm_arguments(algorithm: Union[str, Algorithm], bagua_kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` for an unknown algorithm name or keyword, before any process is started."""
    if isinstance(algorithm, Algorithm):
        if bagua_kwargs:
            raise ValueError(
                f"BaguaStrategy got an Algorithm instance and keyword arguments {sorted(bagua_kwargs)}; "
                "put the hyper-parameters in the instance, or pass the algorithm's name with the keywords"
            )
        return
    if not isinstance(algorithm, str):
        raise ValueError(
            f"BaguaStrategy(algorithm=...) takes a registered name such as 'gradient_allreduce' or an Algorithm "
            f"instance, got {algorithm!r}"
        )
    algorithm_cls = GlobalAlgorithmRegistry.get(algorithm)  # ValueError naming the nearest registered names
    accepted = [p for p in inspect.signature(algorithm_cls).parameters if p != QADAM_OPTIMIZER_KWARG]
    if QADAM_OPTIMIZER_KWARG in bagua_kwargs:
        raise ValueError(
            f"BaguaStrategy(algorithm={algorithm!r}) got {QADAM_OPTIMIZER_KWARG}=...; leave it out: the strategy "
            "passes the QAdamOptimizer returned by configure_optimizers()"
        )
    unknown = sorted(set(bagua_kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"BaguaStrategy(algorithm={algorithm!r}) got unknown keyword arguments {unknown}; "
            f"{algorithm_cls.__name__} accepts {accepted}"
        )


def broadcast_module_state(module: torch.nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers (evaluation without fitting wraps nothing)."""
    if not comm.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            comm.broadcast(tensor.data, src=0)
