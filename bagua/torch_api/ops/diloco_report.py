"""The report before each DiLoCo exchange, over the ranks: the part of
:class:`~bagua.torch_api.ops.diloco_driver.DiLoCoDriver` that runs rounds by time and the link rule in a plain torch
world (:mod:`~bagua.torch_api.ops.diloco_pace` decides, :mod:`~bagua.torch_api.ops.diloco_stats` records).

:class:`PacedRounds` is a base class of the driver (it reads the driver's communicator, pace and fault
tolerance); nothing here is used alone.

On sharded replicas (FSDP2) each shard's replica group reports on its own, so every row is first reduced (MAX)
over the shards of its replica (:attr:`PacedRounds.replica_shards`): each shard of a replica then reports the
replica's slowest step time, its tokens and its waits, every replica group gathers the same table, and all shards
of a replica plan the same inner steps.

Example:
    >>> driver.add_samples(32)  # this inner step's samples, the weight of its pseudo-gradient  # doctest: +SKIP
    >>> driver.records[-1].steps  # the inner steps of each worker in the last round recorded  # doctest: +SKIP
    [10, 5]
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from bagua.torch_api import env
from bagua.torch_api.comm import hierarchy
from bagua.torch_api.comm.collectives import allreduce_inplace
from bagua.torch_api.comm.reduce_op import ReduceOp
from bagua.torch_api.ops.diloco import Fragment
from bagua.torch_api.ops.diloco_exchange import OverRanks, scale_by_tokens
from bagua.torch_api.ops.diloco_stats import RoundRecord, Rounds, StoreRows

__all__ = ["PacedRounds"]


class PacedRounds:
    """Reports, plans and records of rounds by time and the link rule (a base class of
    :class:`~bagua.torch_api.ops.diloco_driver.DiLoCoDriver`)."""

    fault: Any
    pace: Any
    stats: Rounds
    communicator: Any
    group: Any
    submit: Any
    fragments: list[Fragment]
    #: sharded replicas: a communicator over the other shards of this rank's replica (each report row is reduced
    #: over it first, see the module docstring); None: a rank is a whole replica
    replica_shards: Any = None

    @property
    def records(self) -> list[RoundRecord]:
        """One record per round ended, with ``rounds="time"`` or ``sync_every_max`` (see
        :mod:`~bagua.torch_api.ops.diloco_stats`)."""
        return self.stats.records

    def add_samples(self, n: int) -> None:
        """Count ``n`` samples in the current inner step (default 1 per step): with ``rounds="time"`` or
        ``sync_every_max`` (and always under fault tolerance) the average weighs each pseudo-gradient by them."""
        self.pace.add_samples(n)
        if self.fault is not None:
            self.fault.add_samples(n)

    def _report(self, fragment: Fragment, delta: torch.Tensor) -> None:
        """Gather every rank's report row before ``fragment``'s exchange (on the exchange's thread, waited for: it
        absorbs the wait for the slowest rank), scale ``delta`` by this rank's tokens, and at the round's last
        fragment plan the next round."""
        c = self.communicator if self.group is None else hierarchy.exchange_communicator(self.group, False)
        row, out = self.pace.row(self.pace.take_samples(fragment.index)), []
        started = time.monotonic()
        run = lambda: out.append(OverRanks(c).report(self._replica_row(row, delta.device), delta.device))  # noqa: E731
        if self.submit is not None:
            self.submit(run, f"DiLoCo report before fragment {fragment.index}", delta.is_cuda).wait(
                env.get_comm_timeout_s())
        else:
            run()
        self.pace.wait_s += time.monotonic() - started
        table, me = out[0], c.rank()
        scale_by_tokens(delta, table[:, 0].tolist(), me)
        if fragment.index == len(self.fragments) - 1:
            self._round_end(table, me, [str(i) for i in range(c.nranks())])

    def _replica_row(self, row: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``row`` reduced (MAX) over the shards of this rank's replica (:attr:`replica_shards`): the replica's
        slowest step time and waits, and its tokens, the same on each of its shards; ``row`` itself otherwise."""
        shards = self.replica_shards
        if shards is None or shards.nranks() < 2:
            return row
        out = row.to(device)
        allreduce_inplace(out, ReduceOp.MAX, shards)
        return out.cpu()

    def _round_end(self, table: torch.Tensor, me: int, workers: list[str]) -> None:
        """The round's last report: record it, and plan the next round (the link rule, each worker's steps)."""
        base = self.pace.base
        self.pace.plan(table, me)
        self.stats.log = self.fault is not None or me == 0
        self.stats.report(self.pace.round, base, workers, table, me)

    def _publisher(self) -> Optional[Callable[[str], None]]:
        """Under fault tolerance, on the worker's first rank: set this worker's row in the coordinator's store."""
        ft = self.fault
        if ft is None:
            return None
        rows = StoreRows(ft.quorums.store, ft.quorums.prefix, ft.worker)
        return lambda text: rows(text) if ft.ranks is None or ft.ranks.rank == 0 else None
