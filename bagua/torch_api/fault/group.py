"""The gloo group of exactly one round's members, kept while the members are the same processes.

Each round of :class:`~bagua.torch_api.fault.replica.FaultTolerance` runs its collectives and transfers on a gloo
group of its members alone, rendezvoused through the coordinator's store under the quorum's ``epoch`` (the key of
the quorum whose group it reuses: the same processes as the last ok round, see
:mod:`~bagua.torch_api.fault.quorum`). A worker of several ranks (a sharded model) has one group per shard: its
rank ``s`` meets rank ``s`` of every other member.

Example:
    >>> groups = MemberGroup(store, "bagua-ft", hostname="10.0.0.2")  # doctest: +SKIP
    >>> pg = groups.get(quorum, rank=0, timeout_s=30.0)  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch.distributed as dist

from bagua.torch_api.fault.records import Quorum

__all__ = ["MemberGroup"]


class MemberGroup:
    """The current round's gloo group (see the module docstring).

    Args:
        store: the coordinator's store; ``prefix``: the job's keys in it.
        hostname: the address the groups bind to.
    """

    def __init__(self, store: Any, prefix: str, hostname: str) -> None:
        self.store, self.prefix, self.hostname = store, prefix, hostname
        self.group: Optional[Any] = None
        self.epoch: Optional[int] = None

    def get(self, quorum: Quorum, rank: int, timeout_s: float, shard: Optional[int] = None) -> Any:
        """The gloo group of exactly ``quorum``'s members, this process at ``rank``: the last one when the members
        are the same processes; ``shard``: this rank's shard in a worker of several ranks (a group per shard)."""
        if self.group is not None and self.epoch == quorum.epoch:
            return self.group
        self.drop()
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.hostname)]
        per_shard = f"s{shard}/" if shard is not None else ""
        store = dist.PrefixStore(f"{self.prefix}/pg/{quorum.epoch}/{per_shard}", self.store)
        self.group = dist.ProcessGroupGloo(store, rank, len(quorum.members), opts)
        self.epoch = quorum.epoch
        return self.group

    def drop(self) -> None:
        """Abort and forget the group (after a failed round its messages may be unmatched)."""
        if self.group is not None:
            try:
                self.group.abort()
            except RuntimeError:
                pass
        self.group = self.epoch = None
