"""The collectives and point-to-point operations behind :mod:`bagua.torch_api.communication`.

Each takes an optional ``comm`` last (:data:`Comm`), resolved to a :class:`BaguaCommunicator` in one place
(:func:`_resolve`); see the :mod:`~bagua.torch_api.communication` docstring. That module re-exports every public
name here.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from bagua.torch_api.comm.lifecycle import _device_for_backend, _get_default_group
from bagua.torch_api.comm.process_group import BaguaCommunicator, BaguaProcessGroup
from bagua.torch_api.comm.reduce_op import ReduceOp, finish_avg, to_torch_op

# The one list of the collectives' names: communication.py and the package's __init__ export these.
__all__ = [
    "send", "recv", "broadcast", "broadcast_object", "reduce", "reduce_inplace", "allreduce", "allreduce_inplace",
    "allgather", "allgather_inplace", "gather", "gather_inplace", "scatter", "scatter_inplace", "reduce_scatter",
    "reduce_scatter_inplace", "alltoall", "alltoall_inplace", "alltoall_v", "alltoall_v_inplace", "barrier",
]

Comm = Union[BaguaCommunicator, BaguaProcessGroup, dist.ProcessGroup, None]

# torch 2.13 renamed the tensor forms of all-gather and reduce-scatter; older releases only have the old names.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _resolve(comm: Comm) -> BaguaCommunicator:
    """Resolve the ``comm`` argument of every collective; ``None`` is the default group, in this one place."""
    if comm is None:
        return _get_default_group().get_global_communicator()
    if isinstance(comm, BaguaCommunicator):
        return comm
    if isinstance(comm, BaguaProcessGroup):
        return comm.get_global_communicator()
    if isinstance(comm, dist.ProcessGroup):
        ranks = list(range(dist.get_world_size())) if comm is dist.group.WORLD else dist.get_process_group_ranks(comm)
        return BaguaCommunicator(comm, sorted(ranks))
    raise TypeError(f"comm must be a BaguaCommunicator, BaguaProcessGroup or torch ProcessGroup, got {type(comm)}")


def _active(c: BaguaCommunicator) -> bool:
    # A non-member, or a communicator of one rank, has nothing to exchange.
    return c.group is not None and c.nranks() > 1


def _exchanging(
    comm: Comm, send_tensor: torch.Tensor, recv_tensor: torch.Tensor,
    check: Optional[Callable[[BaguaCommunicator], None]] = None,
) -> Optional[BaguaCommunicator]:
    """The communicator of an out-of-place collective, or ``None`` where nothing is left to exchange: a non-member
    returns at once, and a communicator of one rank copies ``send_tensor`` into ``recv_tensor``. ``check``
    validates the arguments of a member first."""
    c = _resolve(comm)
    if c.group is None:
        return None
    if check is not None:
        check(c)
    if not _active(c):
        recv_tensor.view(-1).copy_(send_tensor.view(-1))
        return None
    return c


def _copied(comm: Comm, send_tensor: torch.Tensor, recv_tensor: torch.Tensor) -> Optional[BaguaCommunicator]:
    """The communicator of a reduction into ``recv_tensor``, which then holds ``send_tensor``'s data; ``None``
    on a non-member, which returns at once."""
    c = _resolve(comm)
    if c.group is None:
        return None
    if recv_tensor is not send_tensor:
        recv_tensor.copy_(send_tensor)
    return c


def _chunk(flat: torch.Tensor, i: int, count: int) -> torch.Tensor:
    """Chunk ``i`` of ``count`` elements of a flat tensor (a view)."""
    return flat[i * count : (i + 1) * count]


def send(tensor: torch.Tensor, dst: int, comm: Comm = None) -> None:
    """Send ``tensor`` to rank ``dst`` of the communicator."""
    c = _resolve(comm)
    if _active(c):
        dist.send(tensor, dst=c.global_rank(dst), group=c.group)


def recv(tensor: torch.Tensor, src: int, comm: Comm = None) -> None:
    """Receive into ``tensor`` from rank ``src`` of the communicator."""
    c = _resolve(comm)
    if _active(c):
        dist.recv(tensor, src=c.global_rank(src), group=c.group)


def broadcast(tensor: torch.Tensor, src: int = 0, comm: Comm = None) -> None:
    """Broadcast ``tensor`` from rank ``src`` of the communicator to all its ranks, in place."""
    c = _resolve(comm)
    if _active(c):
        dist.broadcast(tensor, src=c.global_rank(src), group=c.group)


def broadcast_object(obj: Any, src: int = 0, comm: Comm = None) -> Any:
    """Broadcast a JSON-serializable object from rank ``src``; return it on every rank.

    Unlike the original (pickle), the payload is JSON: a peer can never make this process run code.
    """
    c = _resolve(comm)
    if not _active(c):
        return obj
    device = _device_for_backend(c.group)
    if c.rank() == src:
        payload = json.dumps(obj).encode("utf-8")
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=c.global_rank(src), group=c.group)
    if c.rank() == src:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=c.global_rank(src), group=c.group)
    return json.loads(data.cpu().numpy().tobytes().decode("utf-8")) if c.rank() != src else obj


def reduce(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm: Comm = None
) -> None:
    """Reduce ``send_tensor`` of every rank into ``recv_tensor`` on rank ``dst``."""
    c = _copied(comm, send_tensor, recv_tensor)
    if c is not None:
        reduce_inplace(recv_tensor, dst, op, c)


def reduce_inplace(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm: Comm = None) -> None:
    """Reduce ``tensor`` of every rank into ``tensor`` on rank ``dst``."""
    c = _resolve(comm)
    if not _active(c):
        return
    dist.reduce(tensor, dst=c.global_rank(dst), op=to_torch_op(op), group=c.group)
    if c.rank() == dst:
        finish_avg(tensor, op, c.nranks())


def allreduce(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Comm = None
) -> None:
    """Reduce ``send_tensor`` over all ranks into ``recv_tensor`` on every rank."""
    c = _copied(comm, send_tensor, recv_tensor)
    if c is not None:
        allreduce_inplace(recv_tensor, op, c)


def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Comm = None) -> None:
    """Reduce ``tensor`` over all ranks, in place; ``ReduceOp.AVG`` averages."""
    c = _resolve(comm)
    if not _active(c):
        return
    if ReduceOp(op) == ReduceOp.AVG and dist.get_backend(c.group) == "nccl":
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=c.group)
        return
    dist.all_reduce(tensor, op=to_torch_op(op), group=c.group)
    finish_avg(tensor, op, c.nranks())


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Comm = None) -> None:
    """Gather ``send_tensor`` of every rank into the flat ``recv_tensor`` (``nranks * numel`` elements)."""

    def check(c: BaguaCommunicator) -> None:
        n = send_tensor.numel()
        if recv_tensor.numel() != n * c.nranks():
            raise ValueError(f"allgather: recv_tensor needs {n * c.nranks()} elements, has {recv_tensor.numel()}")

    c = _exchanging(comm, send_tensor, recv_tensor, check)
    if c is None:
        return
    all_gather_tensor(recv_tensor.view(-1), send_tensor.contiguous().view(-1), group=c.group)


def allgather_inplace(tensor: torch.Tensor, comm: Comm = None) -> None:
    """All-gather in place: rank ``r`` contributes chunk ``r`` of ``tensor`` (``numel`` divisible by nranks)."""
    c = _resolve(comm)
    if not _active(c):
        return
    chunk = tensor.numel() // c.nranks()
    flat = tensor.view(-1)
    mine = _chunk(flat, c.rank(), chunk).clone()
    all_gather_tensor(flat, mine, group=c.group)


def gather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, comm: Comm = None) -> None:
    """Gather ``send_tensor`` of every rank into the flat ``recv_tensor`` on rank ``dst``."""
    c = _exchanging(comm, send_tensor, recv_tensor)
    if c is None:
        return
    chunks = list(recv_tensor.view(-1).chunk(c.nranks())) if c.rank() == dst else None
    dist.gather(send_tensor.contiguous().view(-1), chunks, dst=c.global_rank(dst), group=c.group)


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm: Comm = None) -> None:
    """Gather chunk ``r`` (``count`` elements) of each rank's ``tensor`` into ``tensor`` on rank ``dst``."""
    c = _resolve(comm)
    if not _active(c):
        return
    flat = tensor.view(-1)
    mine = _chunk(flat, c.rank(), count).clone()
    chunks = [_chunk(flat, i, count) for i in range(c.nranks())] if c.rank() == dst else None
    dist.gather(mine, chunks, dst=c.global_rank(dst), group=c.group)


def scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int, comm: Comm = None) -> None:
    """Scatter the flat ``send_tensor`` of rank ``src``: rank ``r`` receives chunk ``r`` into ``recv_tensor``."""
    c = _exchanging(comm, send_tensor, recv_tensor)
    if c is None:
        return
    chunks = [t.contiguous() for t in send_tensor.view(-1).chunk(c.nranks())] if c.rank() == src else None
    out = recv_tensor.view(-1)
    dist.scatter(out, chunks, src=c.global_rank(src), group=c.group)


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm: Comm = None) -> None:
    """Scatter chunks of ``count`` elements of rank ``src``'s ``tensor`` into chunk ``r`` of rank ``r``."""
    c = _resolve(comm)
    if not _active(c):
        return
    flat = tensor.view(-1)
    chunks = [_chunk(flat, i, count).clone() for i in range(c.nranks())] if c.rank() == src else None
    out = _chunk(flat, c.rank(), count)
    dist.scatter(out, chunks, src=c.global_rank(src), group=c.group)


def reduce_scatter(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Comm = None
) -> None:
    """Reduce ``send_tensor`` (``nranks * recv.numel()`` elements) and give chunk ``r`` to rank ``r``."""
    c = _exchanging(comm, send_tensor, recv_tensor)
    if c is None:
        return
    out = recv_tensor.view(-1)
    reduce_scatter_tensor(out, send_tensor.contiguous().view(-1), op=to_torch_op(op), group=c.group)
    finish_avg(out, op, c.nranks())


def reduce_scatter_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Comm = None) -> None:
    """Reduce-scatter in place: chunk ``r`` of ``tensor`` on rank ``r`` holds the reduction of all chunks ``r``."""
    c = _resolve(comm)
    if not _active(c):
        return
    flat = tensor.view(-1)
    chunk = flat.numel() // c.nranks()
    out = _chunk(flat, c.rank(), chunk)
    result = torch.empty_like(out)
    reduce_scatter_tensor(result, flat.clone(), op=to_torch_op(op), group=c.group)
    out.copy_(result)
    finish_avg(out, op, c.nranks())


def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Comm = None) -> None:
    """All-to-all: chunk ``j`` of rank ``i``'s ``send_tensor`` lands in chunk ``i`` of rank ``j``'s ``recv_tensor``."""

    def check(c: BaguaCommunicator) -> None:
        if send_tensor.numel() % c.nranks():
            raise ValueError(f"alltoall: {send_tensor.numel()} elements do not divide into {c.nranks()} ranks")

    c = _exchanging(comm, send_tensor, recv_tensor, check)
    if c is None:
        return
    dist.all_to_all_single(recv_tensor.view(-1), send_tensor.contiguous().view(-1), group=c.group)


def alltoall_inplace(tensor: torch.Tensor, comm: Comm = None) -> None:
    """All-to-all in place on ``tensor``."""
    c = _resolve(comm)
    if not _active(c):
        return
    alltoall(tensor.clone(), tensor, c)


def alltoall_v(
    send_tensor: torch.Tensor,
    send_counts: list[int],
    send_displs: list[int],
    recv_tensor: torch.Tensor,
    recv_counts: list[int],
    recv_displs: list[int],
    comm: Comm = None,
) -> None:
    """All-to-all with per-rank counts and displacements (in elements)."""
    c = _resolve(comm)
    if c.group is None:
        return
    send_flat, recv_flat = send_tensor.view(-1), recv_tensor.view(-1)
    packed_in = torch.cat([send_flat[d : d + n] for n, d in zip(send_counts, send_displs)])
    if not _active(c):
        recv_flat[recv_displs[0] : recv_displs[0] + recv_counts[0]].copy_(packed_in)
        return
    packed_out = torch.empty(sum(recv_counts), dtype=recv_flat.dtype, device=recv_flat.device)
    dist.all_to_all_single(packed_out, packed_in, list(recv_counts), list(send_counts), group=c.group)
    offset = 0
    for n, d in zip(recv_counts, recv_displs):
        recv_flat[d : d + n].copy_(packed_out[offset : offset + n])
        offset += n


def alltoall_v_inplace(tensor: torch.Tensor, counts: list[int], displs: list[int], comm: Comm = None) -> None:
    """All-to-all with counts and displacements, in place (the same layout is used to send and receive)."""
    alltoall_v(tensor.clone(), counts, displs, tensor, counts, displs, comm)


def barrier(comm: Comm = None) -> None:
    """Block until every rank of the communicator reaches the barrier."""
    c = _resolve(comm)
    if not _active(c):
        return
    flag = torch.zeros(1, device=_device_for_backend(c.group))
    dist.all_reduce(flag, group=c.group)
