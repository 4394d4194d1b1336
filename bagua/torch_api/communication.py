"""Bagua's collectives, with the original signatures, as thin wrappers over ``torch.distributed``.

Every collective takes an optional ``comm`` last: a :class:`BaguaCommunicator`, a :class:`BaguaProcessGroup`
(its global communicator is used), a torch ``ProcessGroup``, or ``None`` for the default group. On a rank that is
not a member of ``comm`` every collective returns at once. Calls are synchronous, as in the original; they work
on CPU tensors with gloo and CUDA tensors with NCCL.

Example:
    >>> import bagua.torch_api as bagua
    >>> bagua.init_process_group()  # doctest: +SKIP
    >>> t = torch.ones(4)
    >>> bagua.allreduce_inplace(t, op=bagua.ReduceOp.AVG)  # doctest: +SKIP
"""

from __future__ import annotations

from bagua.torch_api.comm import coalesced as _coalesced, lifecycle as _lifecycle
from bagua.torch_api.comm.coalesced import allreduce_coalesced_inplace, broadcast_coalesced, init_bagua_communicator
from bagua.torch_api.comm import collectives as _collectives
from bagua.torch_api.comm.collectives import *  # noqa: F403 - the collectives, named once in collectives.__all__
from bagua.torch_api.comm.collectives import Comm, all_gather_tensor, reduce_scatter_tensor
from bagua.torch_api.comm.lifecycle import (  # the original's import path for these
    from_torch_group,
    get_backend,
    init_process_group,
    is_initialized,
    new_group,
    on_shutdown,
)
from bagua.torch_api.comm.process_group import BaguaCommunicator, BaguaProcessGroup
from bagua.torch_api.comm.reduce_op import ReduceOp

# The collectives live in collectives.py, ReduceOp in reduce_op.py, the original's coalesced and communicator
# helpers in coalesced.py, the default group's start and end in lifecycle.py; this module, the original's import
# path, re-exports them.
__all__ = [
    "ReduceOp", "init_process_group", "is_initialized", "new_group", "from_torch_group", "get_backend",
    *_collectives.__all__, "BaguaProcessGroup", "on_shutdown",
]
__all__ += ["broadcast_coalesced", "allreduce_coalesced_inplace", "init_bagua_communicator"]
# public names the module always had without listing them
__all__ += ["Comm", "BaguaCommunicator", "all_gather_tensor", "reduce_scatter_tensor"]

# private names of the original's module that other modules and tests read here
_get_default_group = _lifecycle._get_default_group
_reset = _lifecycle._reset
_rank_not_in_group = _coalesced._rank_not_in_group
