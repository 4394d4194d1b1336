"""Which groups allreduce over several streams, and the allreduce entry points that follow that choice.

Part of :mod:`bagua.torch_api.multistream`: :func:`enable` / :func:`disable` / :func:`get`, the dispatching
:func:`allreduce_inplace` and :func:`all_reduce_async` (Bagua's engine) and the DDP communication hook.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from bagua.torch_api import communication
from bagua.torch_api.communication import ReduceOp
from bagua.torch_api.multistream.choice import StreamChooser, calibrate
from bagua.torch_api.multistream.group import (
    DEFAULT_MIN_CHUNK_BYTES, DEFAULT_NUM_STREAMS, Comm, MultiStreamGroup, _group_key, _torch_group_and_ranks,
)

__all__ = ["enable", "disable", "get", "allreduce_inplace", "all_reduce_async", "MultiWork",
           "multistream_allreduce_hook"]

_registry: dict[int, MultiStreamGroup] = {}
communication.on_shutdown(_registry.clear, order=1)  # at exit: let the streams' groups (and threads) go


def get(group: Comm = None) -> Optional[MultiStreamGroup]:
    """The :class:`MultiStreamGroup` enabled for ``group`` (``None``: the default group), if any."""
    base, _ = _torch_group_and_ranks(group)
    return _registry.get(_group_key(base))


def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Comm = None) -> None:
    """Allreduce ``tensor`` in place over ``comm``: on several streams when :func:`enable` was called for it,
    else exactly :func:`bagua.torch_api.communication.allreduce_inplace`.

    This is the operation Bagua's full-precision bucket allreduce dispatches to.
    """
    base, _ = _torch_group_and_ranks(comm)
    msg = _registry.get(_group_key(base))
    if msg is None or msg.num_streams == 1:
        communication.allreduce_inplace(tensor, op, comm)
        return
    msg.allreduce_(tensor, op)


class MultiWork:
    """The works of one multistream allreduce, waited as one (the interface of ``torch.distributed.Work``
    that Bagua's engine uses: ``wait``, ``is_completed``, ``get_future``)."""

    __slots__ = ("works", "tensor")

    def __init__(self, works: list[Any], tensor: torch.Tensor) -> None:
        self.works = works
        self.tensor = tensor

    def wait(self, timeout: Any = None) -> bool:
        """Wait for every piece (each at most ``timeout``, a ``timedelta``, when given)."""
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        """Whether every piece has finished."""
        return all(work.is_completed() for work in self.works)

    def get_future(self) -> torch.futures.Future:
        """A future completed with ``[tensor]`` once every piece has finished."""
        tensor = self.tensor
        return torch.futures.collect_all([w.get_future() for w in self.works]).then(lambda _: [tensor])


def all_reduce_async(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                     group: Optional[dist.ProcessGroup] = None) -> Any:
    """``torch.distributed.all_reduce(tensor, op, group, async_op=True)``, on several streams when
    :func:`enable` was called for ``group``; returns the work (a :class:`MultiWork` when split).

    This is the call for engines that launch a bucket's allreduce and wait on it later.
    """
    msg = _registry.get(_group_key(group))
    if msg is None or msg.num_streams == 1 or not tensor.is_contiguous():
        return dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return MultiWork(msg._launch(tensor, op), tensor)


def multistream_allreduce_hook(
    state: MultiStreamGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over ``state``'s ranks, its pieces on parallel streams.

    Same arithmetic as torch's ``default_hooks.allreduce_hook`` (divide by the world size, then sum), so the
    result equals DDP's default bucket by bucket.

    Example:
        >>> ddp.register_comm_hook(MultiStreamGroup(ddp.process_group), multistream_allreduce_hook)  # doctest: +SKIP
    """
    if state.chooser is not None and bucket.index() == 0:
        state.chooser.on_iteration()  # the first bucket of every iteration: the clock of the online choice
    buffer = bucket.buffer()
    buffer.div_(len(state.ranks))
    futures = [work.get_future() for work in state.allreduce_async(buffer, ReduceOp.SUM)]
    return torch.futures.collect_all(futures).then(lambda _: buffer)


# DDP's register_comm_hook compares the annotations with the real classes; ``from __future__ import
# annotations`` turned them into strings, so give the hook the objects back.
multistream_allreduce_hook.__annotations__.update(bucket=dist.GradBucket, state=MultiStreamGroup)
multistream_allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def enable(target: Any = None, num_streams: int = DEFAULT_NUM_STREAMS,
           min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES, calibrate_streams: bool = True) -> MultiStreamGroup:
    """Allreduce over several TCP streams; collective: every process calls it, in the same order.

    Args:
        target: a ``torch.nn.parallel.DistributedDataParallel`` (a comm hook is registered on it), a module
            wrapped by Bagua (its group is used), a Bagua or torch group, or ``None`` (Bagua's default group).
            For Bagua, gradient allreduce buckets of that group then go through :func:`all_reduce_async` /
            :func:`allreduce_inplace`.
        num_streams: streams to create (the most that will be used).
        min_chunk_bytes: the smallest piece a tensor is cut into.
        calibrate_streams: choose the stream count by measurement. For DDP: on the first training iterations
            (a :class:`StreamChooser`: 3 warmup iterations, then 4 iterations each of 1, 2, 4 ... streams, then
            the fastest, all ranks alike). For a Bagua group: :func:`calibrate` (a lone allreduce, timed now);
            with ``--enable_bagua_net`` the engine uses autotune instead, on real steps. ``False`` uses
            ``num_streams`` as given.

    Returns:
        The :class:`MultiStreamGroup`; change its ``num_streams`` at any time between steps (autotune does).

    Example:
        >>> msg = multistream.enable(ddp_model, num_streams=4)  # doctest: +SKIP
    """
    if isinstance(target, torch.nn.parallel.DistributedDataParallel):
        msg = MultiStreamGroup(target.process_group, num_streams, min_chunk_bytes)
        if msg.groups and dist.get_backend(msg.groups[0]) != "gloo":
            warnings.warn("multistream splitting is meant for gloo; with NCCL set nccl_socket_env() before "
                          "init_process_group instead", stacklevel=2)
        if calibrate_streams:
            msg.num_streams = 1
            msg.chooser = StreamChooser(msg)
        target.register_comm_hook(msg, multistream_allreduce_hook)
        return msg
    bagua_ddp = getattr(target, "bagua_ddp", None)
    if bagua_ddp is not None:
        target = bagua_ddp.process_group
    elif target is not None and hasattr(target, "process_group") and hasattr(target, "bagua_buckets"):
        target = target.process_group  # the engine object itself
    msg = get(target)
    if msg is None:
        msg = MultiStreamGroup(target, num_streams, min_chunk_bytes)
        base, _ = _torch_group_and_ranks(target)
        _registry[_group_key(base)] = msg
    if calibrate_streams:
        calibrate(msg)
    else:
        msg.num_streams = min(num_streams, msg.max_streams)
    return msg


def disable(group: Comm = None) -> None:
    """Go back to one stream for ``group`` (the created groups stay alive until the process group is destroyed)."""
    base, _ = _torch_group_and_ranks(group)
    _registry.pop(_group_key(base), None)
