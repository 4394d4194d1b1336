"""Process groups: a torch group plus intra-node and inter-node subgroups.

A :class:`BaguaProcessGroup` is what algorithms are bound to. Its *global* communicator spans all its ranks; the
*intra-node* communicator spans the group's ranks on the caller's node; the *inter-node* communicator spans the
node *leaders*. One rule, for every algorithm and any subgroup: a node's leader is the group's lowest rank on that
node, which is also rank 0 of that node's intra-node communicator (so "reduce to intra rank 0, work among the
leaders, broadcast from intra rank 0" always meets the same ranks; :mod:`bagua.torch_api.hierarchy`). A rank
outside a communicator gets one whose ``group`` is ``None``, and every collective on it returns at once, as in the
original Bagua.

:meth:`BaguaProcessGroup.private_copy` gives an engine torch groups of its own over the same ranks, so that what
the engine sends can never interleave with the user's collectives or another engine's.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist


__all__ = ["BaguaCommunicator", "BaguaProcessGroup", "new_torch_group"]


def new_torch_group(
    ranks: list[int], private: bool = False, timeout: Optional[datetime.timedelta] = None
) -> Optional[dist.ProcessGroup]:
    """Create a torch group over ``ranks``; **every** process of the job must call it, in the same order.

    torch names groups by a per-process counter, so creating groups on some processes only would give the
    same group different names on different processes; Bagua therefore creates every group collectively, as
    ``torch.distributed.new_group`` documents. Returns ``None`` on ranks outside ``ranks``. Over all ranks the
    WORLD group is reused, unless ``private``.
    """
    ranks = sorted(ranks)
    if len(ranks) == dist.get_world_size() and not private:
        return dist.group.WORLD
    group = dist.new_group(ranks, timeout=timeout)
    return group if dist.get_rank() in ranks else None


class BaguaCommunicator:
    """One communicator: a torch group (or ``None`` for a non-member) and its ranks.

    Example:
        >>> comm = bagua.communication._get_default_group().get_global_communicator()  # doctest: +SKIP
        >>> comm.nranks(), comm.rank()  # doctest: +SKIP
        (2, 0)
    """

    __slots__ = ("group", "ranks", "stream")

    def __init__(self, group: Optional[dist.ProcessGroup], ranks: list[int], stream=None) -> None:
        self.group = group
        self.ranks = list(ranks)
        self.stream = stream

    def is_member(self) -> bool:
        """Whether the calling rank belongs to this communicator."""
        return self.group is not None

    def nranks(self) -> int:
        """Number of ranks in the communicator."""
        return len(self.ranks)

    def rank(self) -> int:
        """Rank of the caller inside the communicator (-1 for a non-member)."""
        me = dist.get_rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def global_rank(self, group_rank: int) -> int:
        """Global rank of the communicator's ``group_rank``."""
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        return f"BaguaCommunicator(ranks={self.ranks}, member={self.is_member()})"


class BaguaProcessGroup:
    """A group of ranks that an algorithm communicates over, with intra-/inter-node communicators.

    Create it with :func:`bagua.torch_api.communication.new_group` (collective) or
    :func:`~bagua.torch_api.communication.from_torch_group`.

    Args:
        ranks: global ranks of the group, sorted.
        group: the torch group over ``ranks`` (``None`` on ranks outside it).
        name: a name unique in the job.
        stream: the CUDA stream collectives run on (``None`` on CPU).
    """

    def __init__(self, ranks: list[int], group: Optional[dist.ProcessGroup], name: str, stream=None) -> None:
        self.ranks = sorted(ranks)
        self.group = group
        self.group_name = name
        self.stream = stream
        self._global = BaguaCommunicator(group, self.ranks, stream)
        self._layout: Optional[list[tuple[int, int]]] = None
        self._intra: Optional[BaguaCommunicator] = None
        self._inter: Optional[BaguaCommunicator] = None
        self._world_layout: Optional[list[tuple[int, int]]] = None
        self._auxiliary: dict[str, Optional[dist.ProcessGroup]] = {}

    def is_member(self) -> bool:
        """Whether the calling rank belongs to the group."""
        return self.group is not None

    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    def rank(self) -> int:
        """Rank of the caller in the group (-1 for a non-member)."""
        return self._global.rank()

    def get_global_communicator(self) -> BaguaCommunicator:
        """The communicator over all ranks of the group."""
        return self._global

    def get_intra_node_communicator(self) -> BaguaCommunicator:
        """The communicator over the group's ranks on the caller's node."""
        assert self._intra is not None, "the group's communicators are built when the group is created"
        return self._intra

    def get_inter_node_communicator(self) -> BaguaCommunicator:
        """The communicator over the node leaders (``group=None`` on the other ranks)."""
        assert self._inter is not None, "the group's communicators are built when the group is created"
        return self._inter

    def node_layout(self) -> list[tuple[int, int]]:
        """``(node_rank, local_rank)`` of every rank of the group, in group order."""
        assert self._layout is not None, "the group's layout is set when the group is created"
        return self._layout

    def is_hierarchical_possible(self) -> bool:
        """Whether the group spans several nodes with more than one of its ranks on some node."""
        layout = self.node_layout()
        nodes = {n for n, _ in layout}
        return 1 < len(nodes) < len(layout)

    def node_leaders(self) -> list[int]:
        """The global rank of each node's leader (the group's lowest rank on that node), by node."""
        first: dict[int, int] = {}
        for r, (node, _) in zip(self.ranks, self.node_layout()):
            first.setdefault(node, r)
        return [first[n] for n in sorted(first)]

    def _build_hierarchy(self, world_layout: list[tuple[int, int]]) -> None:
        """Create the intra-/inter-node groups; called on every process of the job, in the same order."""
        self._world_layout = list(world_layout)
        self._layout = [world_layout[r] for r in self.ranks]
        by_node: dict[int, list[int]] = {}
        for r in self.ranks:
            by_node.setdefault(world_layout[r][0], []).append(r)
        me = dist.get_rank()
        if not self.is_hierarchical_possible():
            # One node (or one rank per node): the intra communicator is the whole group and the inter one holds
            # the leader alone, so hierarchical algorithms reduce to their flat form.
            self._intra = BaguaCommunicator(self.group, self.ranks, self.stream)
            self._inter = BaguaCommunicator(None, [self.ranks[0]], self.stream)
            return
        for node in sorted(by_node):
            group = new_torch_group(by_node[node], private=True)
            if me in by_node[node]:
                self._intra = BaguaCommunicator(group, by_node[node], self.stream)
        leaders = self.node_leaders()
        self._inter = BaguaCommunicator(new_torch_group(leaders, private=True), leaders, self.stream)
        if self._intra is None:
            self._intra = BaguaCommunicator(None, [], self.stream)

    def private_copy(self, name: str) -> "BaguaProcessGroup":
        """A group over the same ranks whose torch groups (global, intra- and inter-node) are new and its own.

        Collective: every process of the job calls it, in the same order (as ``torch.distributed.new_group``).
        An engine communicates only on its private copy, so nothing it sends can be matched with a message of
        the user's collectives, of Lightning's, or of another wrapped model.
        """
        assert self._world_layout is not None, "the group's layout is set when the group is created"
        group = new_torch_group(self.ranks, private=True)
        stream = torch.cuda.Stream(priority=-1) if self.stream is not None else None
        copy = BaguaProcessGroup(self.ranks, group, name, stream)
        copy._build_hierarchy(self._world_layout)
        return copy

    def auxiliary_group(self, purpose: str, timeout_s: Optional[float] = None) -> Optional[dist.ProcessGroup]:
        """A torch group over the group's ranks for one ``purpose`` (e.g. a background thread), created once.

        Collective the first time a purpose is asked for: every process of the job asks in the same order.
        """
        if purpose not in self._auxiliary:
            timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
            self._auxiliary[purpose] = new_torch_group(self.ranks, private=True, timeout=timeout)
        return self._auxiliary[purpose]

    def __repr__(self) -> str:
        return f"BaguaProcessGroup(name={self.group_name!r}, ranks={self.ranks})"
