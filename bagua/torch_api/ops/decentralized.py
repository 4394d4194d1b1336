"""Bucket operations of decentralized SGD: peer selection, the peer exchange, and the two synchronous ops.

Both :class:`~bagua.torch_api.algorithms.decentralized.DecentralizedAlgorithm` and
:class:`~bagua.torch_api.algorithms.low_precision_decentralized.LowPrecisionDecentralizedAlgorithm` build their
buckets' operations here, and so do ``BaguaBucket.append_decentralized_synchronous_op`` and
``append_low_precision_decentralized_synchronous_op`` for user-written algorithms: one implementation of the
maths (see those classes for the equations).

- :class:`DecentralizedOp` (:func:`decentralized_op`): ``peer_weight = W(bucket weights)``, ``W`` the peer
  average of ``all``, ``shift_one`` or ``ring``; ``op.copy_back_peer_weight(bucket)`` then overwrites the weights
  with it.
- :class:`LowPrecisionDecentralizedOp`: one round of 8-bit difference exchange on a ring, updating the public
  replicas ``x̂_i`` (``weight``), ``x̂_l`` and ``x̂_r`` and setting the weights to ``x̂_i``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api import communication as comm
from bagua.torch_api.comm import hierarchy
from bagua.torch_api.communication import ReduceOp
from bagua.torch_api.codecs import block
from bagua.torch_api.codecs.minmax_uint8 import BLOCK, decode_chunks, encode_chunks, scratch_buffer, wire_buffer
from bagua.torch_api.codecs.registry import GlobalCodecRegistry
from bagua.torch_api.comm.process_group import BaguaCommunicator, BaguaProcessGroup
from bagua.torch_api.ops.base import BucketOp

__all__ = [
    "P2P_SEGMENT",
    "PEER_SELECTION_MODES",
    "DecentralizedOp",
    "LowPrecisionDecentralizedOp",
    "Replicas",
    "copy_weights_from",
    "copy_weights_into",
    "decentralized_op",
    "peer_communicator",
    "ring_neighbours",
    "shift_one_peer",
    "start_exchange",
]

PEER_SELECTION_MODES = ("all", "shift_one", "ring")


# -- peer selection (pure functions) -------------------------------------------------------------------------


def shift_one_peer(rank: int, nranks: int, step: int) -> int:
    """Return the peer of ``rank`` in round ``step`` of ``shift_one`` (``nranks`` even).

    The first half of the ranks is paired with the second half, shifted by one every round, so every pair
    meets once every ``nranks / 2`` rounds; the pairing is symmetric (``peer(peer(r)) == r``).

    Example:
        >>> [shift_one_peer(r, 4, 0) for r in range(4)], [shift_one_peer(r, 4, 1) for r in range(4)]
        ([2, 3, 0, 1], [3, 2, 1, 0])
    """
    half = nranks // 2
    if rank < half:
        return (step + rank) % ((nranks + 1) // 2) + half
    return (rank - half - step) % half


def ring_neighbours(rank: int, nranks: int) -> tuple[int, int]:
    """Return ``(left, right)`` = ``(rank - 1, rank + 1)`` modulo ``nranks``.

    Example:
        >>> ring_neighbours(0, 4)
        (3, 1)
    """
    return (rank - 1) % nranks, (rank + 1) % nranks


#: Bytes per point-to-point message of a peer exchange (see :func:`start_exchange`).
P2P_SEGMENT = 1 << 20


def start_exchange(send: torch.Tensor, received: dict[int, torch.Tensor], c: BaguaCommunicator, tag: int = 0) -> list[Any]:
    """Send ``send`` to every peer in ``received`` (communicator ranks) and receive into ``received[peer]``.

    Returns the works to wait on. Every rank must start its exchanges in the same order; ``tag`` tells apart
    the exchanges of different buckets in flight at the same time. The tensors travel in pieces of
    :data:`P2P_SEGMENT` bytes, sends and receives interleaved: one 100 MB send each way over a gloo pair often ran
    half duplex (1.6 s instead of 0.83 s at 1 Gbit/s on the emulated hosts), the interleaved pieces always reach
    line rate in both directions.
    """
    c.check_point_to_point(send, "the peer exchange of decentralized SGD (peer_selection_mode 'shift_one' or "
                                 "'ring', and low-precision decentralized)")
    flat_send = send.view(-1).view(torch.uint8)
    flat_recv = {p: buf.view(-1).view(torch.uint8) for p, buf in received.items()}
    ops = []
    for a in range(0, max(flat_send.numel(), 1), P2P_SEGMENT):
        for p in received:
            ops.append(dist.P2POp(dist.isend, flat_send[a : a + P2P_SEGMENT], c.global_rank(p), c.group, tag))
            ops.append(dist.P2POp(dist.irecv, flat_recv[p][a : a + P2P_SEGMENT], c.global_rank(p), c.group, tag))
    return dist.batch_isend_irecv(ops)


def peer_communicator(group: BaguaProcessGroup, hierarchical: bool) -> BaguaCommunicator:
    """The communicator whose ranks are the peers: the node leaders when hierarchical, else the whole group."""
    return hierarchy.exchange_communicator(group, hierarchical)


# -- weights <-> flat buffers ----------------------------------------------------------------------------------


def copy_weights_into(bucket, out: torch.Tensor) -> None:
    """Copy the bucket's current weights into the flat ``out``."""
    if bucket.flat is not None and bucket.check_flatten():
        out.copy_(bucket.flat)
        return
    offset = 0
    for t in bucket.tensors:
        out[offset : offset + t.numel()].copy_(t.effective().reshape(-1))
        offset += t.numel()


def copy_weights_from(bucket, src: torch.Tensor, accumulate: bool = False) -> None:
    """Overwrite the bucket's weights with the flat ``src`` (with ``accumulate``: add ``src`` to them)."""
    if bucket.flat is not None and bucket.check_flatten():
        bucket.flat.add_(src) if accumulate else bucket.flat.copy_(src)
        return
    offset = 0
    for t in bucket.tensors:
        part = src[offset : offset + t.numel()].view(t.shape)
        t.effective().add_(part) if accumulate else t.effective().copy_(part)
        offset += t.numel()


# -- full precision -----------------------------------------------------------------------------------------


def _mix_all(tensor: torch.Tensor, c: BaguaCommunicator, step: int, buffers: dict) -> None:
    comm.allreduce_inplace(tensor, ReduceOp.AVG, c)


def _mix_shift_one(tensor: torch.Tensor, c: BaguaCommunicator, step: int, buffers: dict) -> None:
    peer = shift_one_peer(c.rank(), c.nranks(), step)
    received = {peer: _cached(buffers, peer, tensor)}
    for work in start_exchange(tensor, received, c):
        work.wait()
    tensor.add_(received[peer]).div_(2)


def _mix_ring(tensor: torch.Tensor, c: BaguaCommunicator, step: int, buffers: dict) -> None:
    left, right = ring_neighbours(c.rank(), c.nranks())
    received = {p: _cached(buffers, p, tensor) for p in sorted({left, right})}
    for work in start_exchange(tensor, received, c):
        work.wait()
    # with two ranks both neighbours are the same rank: its weights count twice, as in the 3-rank formula
    tensor.add_(received[left]).add_(received[right]).div_(3)


def _cached(buffers: dict, peer: int, like: torch.Tensor) -> torch.Tensor:
    """A receive buffer kept across rounds (allocating ~model-sized tensors every step costs page faults)."""
    buf = buffers.get(peer)
    if buf is None:
        buf = buffers[peer] = torch.empty_like(like)
    return buf


_MIXERS = {"all": _mix_all, "shift_one": _mix_shift_one, "ring": _mix_ring}


class DecentralizedOp(BucketOp):
    """The operation of decentralized SGD: ``peer_weight = W(weights)``, then :meth:`copy_back_peer_weight`.

    The op copies the bucket's weights into ``peer_weight`` (a flat tensor of the bucket's size) and replaces it
    with the peer average; the weights themselves are only read, so forward and backward may run meanwhile.
    Hierarchical: average inside each node, mix among node leaders, broadcast inside each node.

    Args:
        group: the group whose ranks are the peers.
        peer_weight: the flat result buffer (e.g. ``bucket.flattened_tensor()``).
        hierarchical: see above.
        peer_selection_mode: ``"all"``, ``"shift_one"`` or ``"ring"``.
        first_step: the round number of the first execution (``shift_one`` pairs peers by round).

    Attributes:
        step: rounds run so far, plus ``first_step`` (an algorithm sets it when it restores a checkpoint).
    """

    def __init__(
        self,
        group: BaguaProcessGroup,
        peer_weight: torch.Tensor,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        first_step: int = 0,
    ) -> None:
        if peer_selection_mode not in _MIXERS:
            raise ValueError(
                f"unknown peer_selection_mode {peer_selection_mode!r}; available: {', '.join(PEER_SELECTION_MODES)}"
            )
        self.group, self.peer_weight, self.hierarchical = group, peer_weight, hierarchical
        self.step = first_step
        self._mix = _MIXERS[peer_selection_mode]
        self._buffers: dict[int, torch.Tensor] = {}

    def __call__(self, bucket, flat: torch.Tensor) -> None:
        step = self.step
        self.peer_weight[: flat.numel()].copy_(flat)
        hierarchy.run_hierarchically(self.group, self.hierarchical, self.peer_weight,
                                     lambda t, c: self._mix(t, c, step, self._buffers))
        self.step += 1

    def copy_back_peer_weight(self, bucket) -> None:
        """Overwrite the bucket's weights with the peer average of the last round."""
        with torch.no_grad():
            copy_weights_from(bucket, self.peer_weight)


#: The original's name of the operation's constructor.
decentralized_op = DecentralizedOp


# -- low precision --------------------------------------------------------------------------------------------


class Replicas:
    """Per-bucket state of low-precision decentralized SGD (flat, float32).

    Fields: ``mine`` (x̂_i, my public copy), ``left`` / ``right`` (x̂ of my ring neighbours); the code of the
    differences: ``block_codec`` (``None``: MinMaxUInt8 over the whole bucket, the original's; else a block codec of
    :mod:`~bagua.torch_api.codecs.block`) and ``block_size``; scratch buffers ``diff`` (d), ``scratch``, ``wire``
    (my encoded message) and ``received`` (the neighbours' messages, one per distinct neighbour); ``works``: the
    exchange in flight. Buffers are allocated once: fresh model-sized tensors every step cost more than the
    arithmetic (page faults).

    Args:
        mine, left, right: the replicas.
        codec: a name (or alias) of the codec registry (:mod:`~bagua.torch_api.codecs.registry`): ``"chunk"``
            (MinMaxUInt8; here the whole bucket is its one chunk), ``"bf16"``, ``"uint8"``, ``"uint4"``, ``"nf2"``.
        block_size: elements per block of the block codecs.
    """

    __slots__ = ("mine", "left", "right", "block_codec", "block_size", "diff", "scratch", "wire", "received", "works")

    def __init__(self, mine: torch.Tensor, left: torch.Tensor, right: torch.Tensor, codec: str = "chunk",
                 block_size: int = block.DEFAULT_BLOCK) -> None:
        for what, t in (("weight", mine), ("left_peer_weight", left), ("right_peer_weight", right)):
            if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != mine.numel():
                raise ValueError(
                    f"{what} must be a flat float32 tensor of {mine.numel()} elements (the bucket's size), got "
                    f"{t.dtype} of shape {tuple(t.shape)}; use bucket.flattened_tensor().float()"
                )
        self.mine, self.left, self.right = mine, left, right
        self.block_codec, self.block_size = GlobalCodecRegistry.get(codec).block_codec, block_size
        self.diff = torch.empty_like(self.mine)
        self.scratch = scratch_buffer(mine.numel(), mine.device)
        if self.block_codec is None:
            self.wire = wire_buffer(1, mine.numel(), mine.device)
        else:
            nbytes = block.wire_numel(mine.numel(), self.block_codec, block_size)
            self.wire = torch.zeros(nbytes, dtype=torch.uint8, device=mine.device)
        self.received: dict[int, torch.Tensor] = {}
        self.works: list[Any] = []

    @classmethod
    def of(cls, x: torch.Tensor) -> "Replicas":
        """Replicas all equal to the flat ``x`` (every rank holds the same weights at wrap time)."""
        xf = x.detach().float()
        return cls(xf.clone(), xf.clone(), xf.clone())


def _ring_round_start(x: torch.Tensor, r: Replicas, c: BaguaCommunicator, tag: int) -> None:
    """Steps 1-3 of a round (see ``LowPrecisionDecentralizedAlgorithm``): ``d``, ``C = Q(d)``, send/receive."""
    xf = x if x.dtype == torch.float32 else x.float()
    # block by block, so each input is read from memory once and the three operations run in cache
    step = BLOCK if x.device.type == "cpu" else x.numel()
    for a in range(0, x.numel(), step):
        b = min(a + step, x.numel())
        d = torch.add(xf[a:b], r.left[a:b], alpha=1 / 3, out=r.diff[a:b])
        d.add_(r.right[a:b], alpha=1 / 3).sub_(r.mine[a:b], alpha=5 / 3)
    if r.block_codec is None:
        encode_chunks(r.diff.view(1, -1), r.wire, work=r.scratch)
    else:
        block.encode(r.diff, r.block_codec, r.block_size, out=r.wire)
    if c.nranks() == 1:  # a lone node leader: both neighbours are itself, its message goes nowhere
        r.received, r.works = {c.rank(): r.wire}, []
        return
    if not r.received:  # one buffer per distinct neighbour: with two ranks, left and right are the same rank
        r.received = {p: torch.empty_like(r.wire) for p in sorted(set(ring_neighbours(c.rank(), c.nranks())))}
    r.works = start_exchange(r.wire, r.received, c, tag)


def _ring_round_finish(r: Replicas, c: BaguaCommunicator) -> None:
    """Step 4 of a round: wait for the neighbours' messages and add the decoded differences to the replicas."""
    for work in r.works:
        work.wait()
    r.works = []
    left, right = ring_neighbours(c.rank(), c.nranks())
    for wire, replica in ((r.received[left], r.left), (r.received[right], r.right), (r.wire, r.mine)):
        if r.block_codec is None:
            decode_chunks(wire, replica.view(1, -1), accumulate=True, work=r.scratch)
        else:
            block.decode(wire, replica.numel(), r.block_codec, r.block_size, out=replica, accumulate=True)


class LowPrecisionDecentralizedOp(BucketOp):
    """One round of low-precision decentralized SGD on a bucket: ``op(bucket, flat)``.

    Started by :meth:`__call__` (node reduce when hierarchical, then steps 1-3 on the ring); finished by
    :meth:`finish` (step 4, node broadcast, weights = ``x̂_i``). Without a ``pipeline`` the call finishes the round
    at once (the original's blocking op); with one, ``pipeline(self, bucket)`` decides when (the built-in algorithm
    finishes the previous bucket's round while this one is on the wire).

    Args:
        group: the group of the ring.
        replicas: the bucket's :class:`Replicas`.
        hierarchical: average inside each node first and run the ring among node leaders.
        tag: tells apart the exchanges of buckets in flight at the same time.
        pipeline: see above.
    """

    def __init__(
        self,
        group: BaguaProcessGroup,
        replicas: Replicas,
        hierarchical: bool = True,
        tag: int = 0,
        pipeline: Optional[Callable[["LowPrecisionDecentralizedOp", Any], None]] = None,
    ) -> None:
        self.group = group
        self.replicas = replicas
        self.hierarchical = hierarchical
        self.tag = tag
        self.pipeline = pipeline

    def layout(self) -> tuple[bool, BaguaCommunicator]:
        """(whether to go through node leaders, the communicator of the ring)."""
        return (hierarchy.is_hierarchical(self.group, self.hierarchical),
                peer_communicator(self.group, self.hierarchical))

    def __call__(self, bucket, flat: torch.Tensor) -> None:
        hierarchical, c = self.layout()
        if hierarchical:
            hierarchy.reduce_to_leaders(self.group, flat)
        # a lone leader (one node) still runs the update with itself as both neighbours, as the original did
        if c.is_member() and (c.nranks() > 1 or hierarchical):
            _ring_round_start(flat, self.replicas, c, self.tag)
        if self.pipeline is None:
            self.finish(bucket)
        else:
            self.pipeline(self, bucket)

    def finish(self, bucket) -> None:
        """Step 4 of the round started on ``bucket``; then the weights are ``x̂_i``."""
        hierarchical, c = self.layout()
        if c.is_member() and (c.nranks() > 1 or hierarchical):
            _ring_round_finish(self.replicas, c)
        elif not hierarchical:
            return  # a group of one rank
        if hierarchical:
            hierarchy.broadcast_from_leaders(self.group, self.replicas.mine)
        copy_weights_from(bucket, self.replicas.mine)
