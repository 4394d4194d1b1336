"""The round of asynchronous model averaging and the lock it shares with training.

:class:`~bagua.torch_api.algorithms.async_model_average.AsyncModelAverageAlgorithm` runs :func:`average_round`
from its own thread; ``BaguaBucket.append_asynchronous_model_average_op`` wraps the same function as a bucket
operation (:class:`AsyncModelAverageOp`) for user-written algorithms. A round, for buckets with weights ``x``:

1. negotiate (:func:`negotiate`): a MIN-allreduce of a "keep running" flag, so all ranks stop in the same round;
2. snapshot ``s = x`` (under the weight lock);
3. ``a = allreduce_SUM(s) / n`` (without the lock: training goes on);
4. under the weight lock, ``x += a - s``: the average replaces the snapshot and the local progress made during
   the allreduce is kept.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from bagua.torch_api import env
from bagua.torch_api.ops.decentralized import copy_weights_from, copy_weights_into
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.ops.base import BucketOp

__all__ = ["AsyncModelAverageOp", "WeightLock", "average_round", "negotiate"]

_POLL_S = 0.5  # a waiting round re-checks the lock at least this often


class WeightLock:
    """The lock between the training thread and the averaging thread; a waiting round goes first."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._training = False  # held by the training thread (forward to optimizer step)
        self._averaging = False  # held by the averaging thread
        self._round_waiting = False

    def acquire_for_training(self, timeout: float) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: not (self._averaging or self._round_waiting), timeout):
                raise RuntimeError(
                    f"rank {dist.get_rank()}: the async averaging thread kept the weights for more than "
                    f"{timeout:.0f} s; set BAGUA_COMM_TIMEOUT_S to change the limit"
                )
            self._training = True

    def release_for_training(self) -> None:
        with self._cv:
            self._training = False
            self._cv.notify_all()

    def acquire_for_round(self) -> None:
        """Wait until training releases the weights (at the end of its step, or in ``abort``).

        A round never gives up here: its peers are in the same round and expect its next collective.
        """
        with self._cv:
            self._round_waiting = True
            try:
                while self._training:
                    self._cv.wait(_POLL_S)
                self._averaging = True
            finally:
                self._round_waiting = False

    def release_for_round(self) -> None:
        with self._cv:
            self._averaging = False
            self._cv.notify_all()


def flat_like(bucket) -> torch.Tensor:
    """An uninitialized flat tensor of the bucket's size, dtype and device."""
    return torch.empty(bucket.numel + bucket.padding, dtype=bucket.dtype, device=bucket.device)


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def negotiate(keep_running: bool, device: torch.device, group: Optional[dist.ProcessGroup], nranks: int) -> bool:
    """True while every rank keeps running: a MIN-allreduce of each rank's "keep running" flag."""
    flag = torch.tensor([1 if keep_running else 0], dtype=torch.int32, device=device)
    if nranks > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def average_round(
    rounds: Sequence[tuple[object, tuple[torch.Tensor, torch.Tensor]]],
    lock: WeightLock,
    group: Optional[dist.ProcessGroup],
    nranks: int,
) -> None:
    """Steps 2-4 of a round over ``rounds`` = ``[(bucket, (snapshot, average buffer)), ...]``."""
    lock.acquire_for_round()
    try:
        for bucket, (snapshot, _) in rounds:
            copy_weights_into(bucket, snapshot)
            _sync(snapshot)
    finally:
        lock.release_for_round()
    for _, (snapshot, average) in rounds:
        average.copy_(snapshot)
        if nranks > 1:
            dist.all_reduce(average, group=group)
            average.div_(nranks)
        average.sub_(snapshot)
    lock.acquire_for_round()
    try:
        with torch.no_grad():
            for bucket, (_, delta) in rounds:
                copy_weights_from(bucket, delta, accumulate=True)
                _sync(delta)
    finally:
        lock.release_for_round()


class AsyncModelAverageOp(BucketOp):
    """One round of asynchronous model averaging as a bucket operation ``op(bucket, flat)``.

    Each execution negotiates first; once some rank has called :meth:`abort`, every rank's op stops averaging in
    the same round and :meth:`get_status` turns False, until :meth:`reset` on every rank.

    Args:
        group: the group to average over; the op communicates on a torch group of its own over the same ranks
            (``group.auxiliary_group``, created now, collectively), so a round running on another thread never
            interleaves with the group's other collectives.
        peer_selection_mode: ``"all"`` (the only mode).
    """

    def __init__(self, group: BaguaProcessGroup, peer_selection_mode: str = "all") -> None:
        if peer_selection_mode != "all":
            raise ValueError(f"asynchronous model averaging supports peer_selection_mode='all' only, "
                             f"got {peer_selection_mode!r}")
        self.group = group
        self._torch_group = group.auxiliary_group("async-averaging", env.get_comm_timeout_s())
        self.lock = WeightLock()
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._abort = False  # this rank asked to stop
        self._stopped = False  # the ranks agreed to stop

    def __call__(self, bucket, flat: torch.Tensor) -> None:
        if self._stopped:
            return
        torch_group, nranks = self._torch_group, len(self.group.ranks)
        if not negotiate(not self._abort, bucket.device, torch_group, nranks):
            self._stopped = True
            return
        buffers = self._buffers.get(bucket.name)
        if buffers is None:
            buffers = self._buffers[bucket.name] = (flat_like(bucket), flat_like(bucket))
        average_round([(bucket, buffers)], self.lock, torch_group, nranks)

    def lock_weight(self) -> None:
        """Keep rounds from changing the weights until :meth:`unlock_weight` (training thread)."""
        self.lock.acquire_for_training(env.get_comm_timeout_s())

    def unlock_weight(self) -> None:
        """Let rounds change the weights again."""
        self.lock.release_for_training()

    def abort(self) -> None:
        """Stop averaging on every rank from the next round on."""
        self._abort = True
        self.lock.release_for_training()

    def reset(self) -> None:
        """Average again after :meth:`abort`: the op's initial state (every rank must call it)."""
        self._abort = False
        self._stopped = False

    def get_status(self) -> bool:
        """Whether the op still averages (False once the ranks agreed to stop)."""
        return not self._stopped
