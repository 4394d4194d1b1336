"""More names of the original's communication module: coalesced broadcast and allreduce, a communicator of its
own over all ranks (:func:`init_bagua_communicator`) and the ``_rank_not_in_group`` test.

Part of :mod:`bagua.torch_api.communication`, which re-exports these names.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from bagua.torch_api.comm.collectives import Comm, _active, _resolve, allreduce_inplace, broadcast
from bagua.torch_api.comm.lifecycle import _get_default_group
from bagua.torch_api.comm.process_group import BaguaCommunicator, BaguaProcessGroup
from bagua.torch_api.comm.reduce_op import ReduceOp

__all__ = ["broadcast_coalesced", "allreduce_coalesced_inplace", "init_bagua_communicator"]


def _rank_not_in_group(group: Union[BaguaProcessGroup, BaguaCommunicator, dist.ProcessGroup, None] = None) -> bool:
    """Whether the calling rank is outside ``group`` (``None``, the default group, contains every rank).

    Example:
        >>> _rank_not_in_group(bagua.communication.new_group([0]))  # on rank 1  # doctest: +SKIP
        True
    """
    if group is None:
        return False
    if isinstance(group, (BaguaProcessGroup, BaguaCommunicator)):
        return not group.is_member()
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what torch's new_group returns to ranks outside it
        return True
    return _resolve(group).group is None


def _coalesced_buffer(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    if not tensors:
        raise ValueError(f"{what} needs at least one tensor")
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        raise ValueError(f"{what} needs tensors of one dtype and device, got {sorted(map(str, kinds))}; "
                         "call it once per dtype/device")
    return torch.cat([t.reshape(-1) for t in tensors])


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _on_one_buffer(
    tensors: list[torch.Tensor], comm: Comm, what: str, collective: Callable[[torch.Tensor, BaguaCommunicator], None]
) -> None:
    """Run ``collective(flat, communicator)`` on the tensors packed into one flat buffer, then copy them back."""
    c = _resolve(comm)
    if not _active(c):
        return
    tensors = list(tensors)
    flat = _coalesced_buffer(tensors, what)
    collective(flat, c)
    _copy_back(flat, tensors)


def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0, comm: Comm = None) -> None:
    """Broadcast several tensors from rank ``src`` as one flat message, in place.

    Args:
        tensors: tensors of one dtype and device, the same shapes on every rank.
        src: the sending rank of the communicator.
        comm: see the module docstring.

    Example:
        >>> bagua.communication.broadcast_coalesced([w, b], src=0)  # doctest: +SKIP
    """
    _on_one_buffer(tensors, comm, "broadcast_coalesced", lambda flat, c: broadcast(flat, src, c))


def allreduce_coalesced_inplace(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM, comm: Comm = None) -> None:
    """Reduce several tensors over all ranks as one flat message, in place (``ReduceOp.AVG`` averages).

    Args:
        tensors: tensors of one dtype and device, the same shapes on every rank.
        op: the reduction.
        comm: see the module docstring.

    Example:
        >>> bagua.communication.allreduce_coalesced_inplace([g1, g2], op=bagua.ReduceOp.AVG)  # doctest: +SKIP
    """
    _on_one_buffer(tensors, comm, "allreduce_coalesced_inplace", lambda flat, c: allreduce_inplace(flat, op, c))


def init_bagua_communicator(model_name: str = "", stream: Optional[Any] = None) -> BaguaCommunicator:
    """Create a communicator over all ranks on a torch group of its own; a collective, like ``new_group``.

    Being its own group, it can be aborted (:meth:`BaguaCommunicator.abort`) without touching the default group.

    Args:
        model_name: kept for the original's signature; unused.
        stream: the CUDA stream to record on the communicator (``None`` on CPU).

    Returns:
        A :class:`BaguaCommunicator` whose methods (``allreduce_inplace``...) run collectives on it.

    Example:
        >>> comm = bagua.communication.init_bagua_communicator(model_name="m")  # doctest: +SKIP
        >>> comm.allreduce_inplace(t, bagua.ReduceOp.AVG)  # doctest: +SKIP
    """
    _get_default_group()
    ranks = list(range(dist.get_world_size()))
    return BaguaCommunicator(dist.new_group(ranks), ranks, stream)
