"""The multistream group: ``K`` torch groups over the same ranks, a large allreduce cut across them.

Part of :mod:`bagua.torch_api.multistream` (its docstring says when and how to turn it on).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Union

import torch
import torch.distributed as dist

from bagua.torch_api import communication
from bagua.torch_api.communication import ReduceOp
from bagua.torch_api.comm.process_group import BaguaCommunicator, BaguaProcessGroup
from bagua.torch_api.comm.reduce_op import finish_avg, to_torch_op

__all__ = ["DEFAULT_NUM_STREAMS", "DEFAULT_MIN_CHUNK_BYTES", "Comm", "IterationClock", "MultiStreamGroup"]


#: Streams created by :func:`enable` when none is given (:func:`calibrate` then keeps 1, 2 or 4). With a per-flow
#: cap, 4 streams gave the most on the emulated hosts (docs/tcp_tuning.md); Bagua-Net's own default was 2.
DEFAULT_NUM_STREAMS = 4
#: A piece smaller than this goes on fewer streams: below ~1 MiB the per-collective cost outweighs the gain
#: (Bagua-Net's BAGUA_NET_MIN_CHUNKSIZE was 1 MiB for the same reason).
DEFAULT_MIN_CHUNK_BYTES = 1 << 20

Comm = Union[BaguaCommunicator, BaguaProcessGroup, dist.ProcessGroup, None]


class IterationClock(Protocol):
    """What a group's ``chooser`` is to the DDP hook: told of every training iteration (a
    :class:`~bagua.torch_api.multistream.choice.StreamChooser`, which sets the group's stream count)."""

    def on_iteration(self) -> None:
        """Note that a training iteration begins."""


def _torch_group_and_ranks(group: Comm) -> tuple[Optional[dist.ProcessGroup], list[int]]:
    """The torch group and global ranks behind any kind of ``group`` (``None``: the default group)."""
    if group is None:
        c = communication._get_default_group().get_global_communicator() if communication.is_initialized() else None
        if c is None:
            return dist.group.WORLD, list(range(dist.get_world_size()))
        return c.group, list(c.ranks)
    if isinstance(group, BaguaProcessGroup):
        c = group.get_global_communicator()
        return c.group, list(c.ranks)
    if isinstance(group, BaguaCommunicator):
        return group.group, list(group.ranks)
    if group is dist.group.WORLD:
        return group, list(range(dist.get_world_size()))
    return group, sorted(dist.get_process_group_ranks(group))


def _group_key(group: Optional[dist.ProcessGroup]) -> int:
    return id(group if group is not None else dist.group.WORLD)


class MultiStreamGroup:
    """``max_streams`` torch groups over the same ranks, used in parallel for large allreduces.

    Creating one is collective: **every** process of the job calls the constructor, in the same order (each
    stream is a ``torch.distributed.new_group``). Stream 0 is ``group`` itself, so with one active stream this
    is exactly a plain allreduce.

    Args:
        group: the group to speed up (a Bagua group or communicator, a torch group, or ``None`` for the default).
        max_streams: groups to create (1 to 16); :attr:`num_streams` may later be lowered, e.g. by autotune.
        min_chunk_bytes: the smallest piece a tensor is cut into; smaller tensors use fewer streams.

    Example:
        >>> msg = MultiStreamGroup(max_streams=4)  # doctest: +SKIP
        >>> msg.allreduce_(flat)  # sum over all ranks, in place  # doctest: +SKIP
    """

    __slots__ = ("ranks", "groups", "min_chunk_bytes", "_num_streams", "chooser", "calls", "split_calls")

    def __init__(self, group: Comm = None, max_streams: int = DEFAULT_NUM_STREAMS,
                 min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES) -> None:
        if not 1 <= max_streams <= 16:
            raise ValueError(f"max_streams must be between 1 and 16, got {max_streams}; 2 to 4 is usually enough")
        if min_chunk_bytes < 1:
            raise ValueError(f"min_chunk_bytes must be a positive number of bytes, got {min_chunk_bytes}")
        if not dist.is_initialized():
            raise RuntimeError("MultiStreamGroup needs torch.distributed to be initialized first")
        base, ranks = _torch_group_and_ranks(group)
        # user settings
        self.ranks = ranks
        self.min_chunk_bytes = min_chunk_bytes
        # internal state: every process creates the same groups in the same order (dist.new_group's contract)
        extra = [dist.new_group(ranks) for _ in range(max_streams - 1)]
        self.groups: list[Optional[dist.ProcessGroup]] = [base] + extra if base is not None else []
        self._num_streams = max_streams
        self.chooser: Optional[IterationClock] = None
        # stats
        self.calls = 0
        self.split_calls = 0

    @property
    def max_streams(self) -> int:
        """Number of streams created."""
        return max(len(self.groups), 1)

    @property
    def num_streams(self) -> int:
        """Streams a large tensor is spread over (at most :attr:`max_streams`)."""
        return self._num_streams

    @num_streams.setter
    def num_streams(self, value: int) -> None:
        if not 1 <= int(value) <= self.max_streams:
            raise ValueError(f"num_streams must be between 1 and {self.max_streams} (the streams created), got {value}")
        self._num_streams = int(value)

    def is_member(self) -> bool:
        """Whether the calling rank belongs to the group."""
        return bool(self.groups)

    def pieces(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Cut a contiguous ``tensor`` into at most :attr:`num_streams` contiguous views of about equal size."""
        flat = tensor.view(-1)
        nbytes = flat.numel() * flat.element_size()
        k = max(1, min(self._num_streams, nbytes // self.min_chunk_bytes, flat.numel()))
        return list(torch.tensor_split(flat, k)) if k > 1 else [flat]

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Allreduce ``tensor`` in place, its pieces on parallel streams; ``ReduceOp.AVG`` averages.

        Returns ``tensor``. A non-contiguous tensor goes through a contiguous copy.
        """
        if not self.is_member() or len(self.ranks) < 2:
            return tensor
        if not tensor.is_contiguous():
            work = tensor.contiguous()
            self.allreduce_(work, op)
            tensor.copy_(work)
            return tensor
        for work in self.allreduce_async(tensor, op):
            work.wait()
        finish_avg(tensor, op, len(self.ranks))
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> list[Any]:
        """Launch the pieces' allreduces (SUM for ``AVG``; the caller divides) and return their works."""
        return self._launch(tensor, to_torch_op(op))

    def _launch(self, tensor: torch.Tensor, torch_op: Any) -> list[Any]:
        pieces = self.pieces(tensor)
        self.calls += 1
        self.split_calls += len(pieces) > 1
        return [dist.all_reduce(p, op=torch_op, group=g, async_op=True) for p, g in zip(pieces, self.groups)]

    def __repr__(self) -> str:
        return (f"MultiStreamGroup(ranks={self.ranks}, num_streams={self._num_streams}/{self.max_streams}, "
                f"min_chunk_bytes={self.min_chunk_bytes})")

