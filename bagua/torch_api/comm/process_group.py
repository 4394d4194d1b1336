"""Process groups: a torch group plus intra-node and inter-node subgroups.

A :class:`BaguaProcessGroup` is what algorithms are bound to. Its *global* communicator spans all its ranks; the
*intra-node* communicator spans the group's ranks on the caller's node; the *inter-node* communicator spans the
node *leaders*. One rule, for every algorithm and any subgroup: a node's leader is the group's lowest rank on that
node, which is also rank 0 of that node's intra-node communicator (so "reduce to intra rank 0, work among the
leaders, broadcast from intra rank 0" always meets the same ranks; :mod:`bagua.torch_api.comm.hierarchy`). A rank
outside a communicator gets one whose ``group`` is ``None``, and every collective on it returns at once, as in the
original Bagua.

:meth:`BaguaProcessGroup.private_copy` gives an engine torch groups of its own over the same ranks, so that what
the engine sends can never interleave with the user's collectives or another engine's.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Optional

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
    if not ranks:
        return None  # a group without members (torch refuses an empty rank list): every rank is outside it
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

    # The original's communicator methods. Ranks (``peer``, ``root``) are ranks of this communicator and ``op`` a
    # ``ReduceOp`` value; a non-member, a one-rank communicator and an aborted one return at once.

    def send(self, tensor, peer: int) -> None:
        """Send ``tensor`` to rank ``peer`` of the communicator."""
        if self._runs():
            self.check_point_to_point(_plain(tensor), "BaguaCommunicator.send")
            dist.send(_plain(tensor), self.global_rank(peer), group=self.group)  # gloo's p2p work only ends in wait()

    def recv(self, tensor, peer: int) -> None:
        """Receive into ``tensor`` from rank ``peer`` of the communicator."""
        if self._runs():
            self.check_point_to_point(_plain(tensor), "BaguaCommunicator.recv")
            dist.recv(_plain(tensor), self.global_rank(peer), group=self.group)

    def broadcast(self, tensor, root: int) -> None:
        """Broadcast ``tensor`` from rank ``root``, in place."""
        if self._runs():
            self._wait(dist.broadcast(_plain(tensor), self.global_rank(root), group=self.group, async_op=True))

    def reduce_inplace(self, tensor, root: int, op: int = 0) -> None:
        """Reduce ``tensor`` of every rank into ``tensor`` on rank ``root``."""
        if self._runs():
            t = _plain(tensor)
            self._wait(dist.reduce(t, self.global_rank(root), op=_torch_op(op), group=self.group, async_op=True))
            if self.rank() == root:
                _finish(t, op, self.nranks())

    def reduce(self, send_tensor, recv_tensor, root: int, op: int = 0) -> None:
        """Reduce ``send_tensor`` of every rank into ``recv_tensor`` on rank ``root``."""
        _plain(recv_tensor).copy_(_plain(send_tensor))
        self.reduce_inplace(recv_tensor, root, op)

    def allreduce_inplace(self, tensor, op: int = 0) -> None:
        """Reduce ``tensor`` over all ranks, in place; ``ReduceOp.AVG`` (10) averages.

        Example:
            >>> comm.allreduce_inplace(t, 10)  # doctest: +SKIP
        """
        if self._runs():
            t = _plain(tensor)
            self._wait(dist.all_reduce(t, op=_torch_op(op), group=self.group, async_op=True))
            _finish(t, op, self.nranks())

    def allreduce(self, send_tensor, recv_tensor, op: int = 0) -> None:
        """Reduce ``send_tensor`` over all ranks into ``recv_tensor``."""
        _plain(recv_tensor).copy_(_plain(send_tensor))
        self.allreduce_inplace(recv_tensor, op)

    def allgather(self, send_tensor, recv_tensor) -> None:
        """Gather ``send_tensor`` of every rank into ``recv_tensor`` (``nranks`` times as many elements)."""
        if self._runs():
            out, src = _plain(recv_tensor), _plain(send_tensor)
            chunks = list(out.reshape(-1).chunk(self.nranks()))
            self._wait(dist.all_gather(chunks, src.reshape(-1), group=self.group, async_op=True))

    def allgather_inplace(self, tensor) -> None:
        """All-gather where rank ``r``'s contribution is the ``r``-th chunk of ``tensor``."""
        t = _plain(tensor)
        mine = t.reshape(-1).chunk(self.nranks())[max(self.rank(), 0)].clone()
        self.allgather(mine, t)

    def alltoall(self, send_tensor, recv_tensor) -> None:
        """Send the ``r``-th equal chunk of ``send_tensor`` to rank ``r``; receive into ``recv_tensor``."""
        if self._runs():
            out, src = _plain(recv_tensor).reshape(-1), _plain(send_tensor).reshape(-1)
            self._wait(dist.all_to_all_single(out, src, group=self.group, async_op=True))

    def alltoall_inplace(self, tensor) -> None:
        """All-to-all from and into ``tensor``."""
        t = _plain(tensor)
        self.alltoall(t.clone(), t)

    def barrier(self) -> None:
        """Return once every rank of the communicator has called it."""
        if self._runs():
            self._wait(dist.barrier(group=self.group, async_op=True))

    def abort(self) -> None:
        """Abort the communicator, from any thread: a collective waiting on it returns, later ones do nothing.

        Point-to-point calls are not interrupted (gloo completes them only inside a blocking wait).
        As in the original, the aborted calls return without an error and leave their tensors undefined;
        :meth:`check_abort` tells whether it happened. The torch group is aborted too where its backend supports
        it (NCCL), so a kernel stuck on a peer that never comes ends. Use a communicator of its own
        (:func:`~bagua.torch_api.communication.init_bagua_communicator`) for anything you may abort.
        """
        if self.group is None or self.check_abort():
            return
        _ABORTED.append(self.group)
        try:
            self.group.abort()
        except (RuntimeError, NotImplementedError, AttributeError):  # gloo: our wait loop alone ends the call
            pass

    def check_abort(self) -> bool:
        """Whether :meth:`abort` was called on this communicator (or another one on the same torch group)."""
        return any(g is self.group for g in _ABORTED)

    def check_point_to_point(self, tensor: torch.Tensor, what: str) -> None:
        """Raise a ``ValueError`` naming the fix where ``what`` would send ``tensor`` point to point over gloo from
        GPU memory: gloo's ``send``/``recv`` are CPU-only in torch, and its TCP transport reads a CUDA tensor's
        pointer as host memory (a crash or garbage, never an error of its own). Every rank raises it before any
        byte moves. Collectives (``all_reduce``, ``broadcast``) are not affected: gloo reduces CUDA tensors.
        """
        if tensor.is_cuda and self.group is not None and dist.get_backend(self.group) == "gloo":
            raise ValueError(
                f"{what} sends point to point, which the gloo backend cannot do with CUDA tensors (torch's gloo "
                "send/recv are CPU-only): initialize with backend='nccl' (one GPU per rank), or train on CPU "
                "tensors with gloo; gloo's collectives (gradient_allreduce, decentralized with peer_selection_mode="
                "'all', async, DiLoCo without compression) do work on CUDA tensors"
            )

    def _runs(self) -> bool:
        return self.group is not None and self.nranks() > 1 and not self.check_abort()

    def _wait(self, work) -> None:
        """Wait for ``work``, polling so that :meth:`abort` from another thread ends the wait."""
        if work is None:
            return
        while not work.is_completed():
            if self.check_abort():
                return
            time.sleep(_POLL_S)
        work.wait()


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
        """Whether some node holds more than one of the group's ranks (one node of several ranks included).

        Hierarchical mode then reduces inside each node first, as in the original: on one node the exchange runs
        on the node's leader alone. With one rank per node it is the flat form.
        """
        layout = self.node_layout()
        nodes = {n for n, _ in layout}
        return len(nodes) < len(layout)

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
            # One rank per node (or a group of one): hierarchical algorithms take their flat form, so the intra
            # communicator (never used) is the whole group and the inter one holds the first rank alone.
            self._intra = BaguaCommunicator(self.group, self.ranks, self.stream)
            self._inter = BaguaCommunicator(None, self.ranks[:1], self.stream)
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


# Torch groups whose communicators were aborted (a communicator has fixed slots, so the mark lives here).
_ABORTED: list = []
_POLL_S = 0.0005


def _plain(tensor: Any) -> torch.Tensor:
    """The torch tensor behind what the original's communicator methods accept."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    effective = getattr(tensor, "effective", None)  # a BaguaTensor
    if callable(effective):
        return effective()
    raise TypeError(f"expected a torch.Tensor (or a BaguaTensor), got {type(tensor).__name__}")


def _torch_op(op: int) -> dist.ReduceOp:
    from bagua.torch_api.comm.reduce_op import to_torch_op

    return to_torch_op(op)


def _finish(tensor: torch.Tensor, op: int, n: int) -> None:
    from bagua.torch_api.comm.reduce_op import finish_avg

    finish_avg(tensor, op, n)
