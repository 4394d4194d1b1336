"""The ranks of one worker that holds a model sharded over several processes (FSDP2 inside a worker).

A worker of a fault-tolerant job may be a job of several ranks, each holding one shard of the model. Its first rank
speaks for it to the coordinator (registration, heartbeat, the quorum and the verdict of each round) and shares
what it learns with the others; each rank then exchanges its own shard with the same shard's ranks of the other
members (see :class:`~bagua.torch_api.fault.replica.FaultTolerance`). A round is ``ok`` for the worker only when it
was ``ok`` on every one of its shards: one shard retried while the others moved on would part the model.

What the ranks share travels as JSON on a gloo group of the worker's own ranks, never pickled. An error on the
first rank (a quorum that did not close, a lost coordinator, settings that differ) reaches every rank as the same
kind of error with the same message, so every rank of the worker stops, and its launcher restarts it.

Example:
    >>> ranks = WorkerRanks(list(range(dist.get_world_size())), timeout_s=660.0)  # collective  # doctest: +SKIP
    >>> quorum = ranks.share(lambda: quorums.wait(key, me))  # runs on the first rank only  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Callable

import torch
import torch.distributed as dist

from bagua.torch_api.fault.quorum import CoordinatorLost, Excluded, JobEnded
from bagua.torch_api.fault.secret import NotAdmitted

__all__ = ["WorkerRanks"]

_RAISED: dict[str, type[Exception]] = {
    "Excluded": Excluded, "CoordinatorLost": CoordinatorLost, "TimeoutError": TimeoutError, "ValueError": ValueError,
    "JobEnded": JobEnded, "NotAdmitted": NotAdmitted,
}


class WorkerRanks:
    """The gloo group of one worker's ``ranks`` (global ranks of its own torch world; collective: every rank of
    that world calls it, in the same order). Its waits fail after ``timeout_s``.

    Attributes: ``rank`` (this process's index among the worker's ranks: its shard), ``size``.
    """

    def __init__(self, ranks: list[int], timeout_s: float) -> None:
        ranks = sorted(ranks)
        self.group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.root = ranks[0]
        self.rank = ranks.index(dist.get_rank())
        self.size = len(ranks)

    def share(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the first rank and return its JSON-able result on every rank; what it raised, every rank
        raises (the same class for the errors a round can end in, with the same message)."""
        if self.rank == 0:
            try:
                value, raised = fn(), None
            except Exception as exc:  # noqa: BLE001 - every rank raises it, below
                value, raised = None, exc
            message = {"value": value} if raised is None else {"error": type(raised).__name__, "text": str(raised)}
            self._broadcast(json.dumps(message).encode())
            if raised is not None:
                raise raised
            return value
        message = json.loads(self._broadcast(None).decode())
        if "error" in message:
            kind = _RAISED.get(message["error"], RuntimeError)
            raise kind(f"{message['text']} (from the worker's first rank)")
        return message["value"]

    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank of the worker."""
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _broadcast(self, payload: bytes | None) -> bytes:
        length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(length, self.root, group=self.group)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None
                else torch.empty(int(length.item()), dtype=torch.uint8))
        if data.numel():
            dist.broadcast(data, self.root, group=self.group)
        return data.numpy().tobytes()
