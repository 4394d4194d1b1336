"""Decentralized SGD: every rank averages its *weights* with a few peers instead of allreducing gradients.

Two algorithms, as in the original Bagua:

- :class:`DecentralizedAlgorithm` (D-PSGD, https://arxiv.org/abs/1705.09056): every ``communication_interval``
  steps, each rank sends a snapshot of its weights to its peers *while forward and backward run*; after backward
  the weights are replaced by the peer average, then the optimizer steps with the gradient taken at the
  pre-averaging weights::

      x_{t+1} = W(x_t) - lr * g(x_t)

  ``W`` is the peer average: ``all`` (exact global average), ``shift_one`` (pairs that change every round) or
  ``ring`` (left and right neighbours, 1/3 each).
- :class:`LowPrecisionDecentralizedAlgorithm` (https://arxiv.org/abs/1803.06443): after each optimizer step the
  ranks of a ring exchange 8-bit MinMaxUInt8 *differences* and keep public replicas ``x̂`` of themselves and of
  both neighbours, so only one byte per weight crosses the network.

*Hierarchical* (both, when the group spans several nodes of several ranks): average inside each node, run the
exchange among node leaders (so the peers are nodes), broadcast the result inside each node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from bagua.torch_api import communication as comm
from bagua.torch_api import hierarchy
from bagua.torch_api.algorithms._checks import check_bool, check_choice, check_int
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms.nonfinite import agree_on_finite_gradients
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.communication import ReduceOp
from bagua.torch_api.process_group import BaguaCommunicator, BaguaProcessGroup
from bagua.torch_api.tensor import BaguaTensor, weight_tensor

__all__ = [
    "DecentralizedAlgorithm",
    "DecentralizedAlgorithmImpl",
    "LowPrecisionDecentralizedAlgorithm",
    "LowPrecisionDecentralizedAlgorithmImpl",
    "PEER_SELECTION_MODES",
    "shift_one_peer",
    "ring_neighbours",
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


#: Bytes per point-to-point message of a peer exchange (see :func:`_start_exchange`).
P2P_SEGMENT = 1 << 20


def _start_exchange(
    send: torch.Tensor, received: dict[int, torch.Tensor], c: BaguaCommunicator, tag: int = 0
) -> list[Any]:
    """Send ``send`` to every peer in ``received`` (communicator ranks) and receive into ``received[peer]``.

    Returns the works to wait on. Every rank must start its exchanges in the same order; ``tag`` tells apart
    the exchanges of different buckets in flight at the same time. The tensors travel in pieces of
    :data:`P2P_SEGMENT` bytes, sends and receives interleaved: one 100 MB send each way over a gloo pair often ran
    half duplex (1.6 s instead of 0.83 s at 1 Gbit/s on the emulated hosts), the interleaved pieces always reach
    line rate in both directions.
    """
    flat_send = send.view(-1).view(torch.uint8)
    flat_recv = {p: buf.view(-1).view(torch.uint8) for p, buf in received.items()}
    ops = []
    for a in range(0, max(flat_send.numel(), 1), P2P_SEGMENT):
        for p in received:
            ops.append(dist.P2POp(dist.isend, flat_send[a : a + P2P_SEGMENT], c.global_rank(p), c.group, tag))
            ops.append(dist.P2POp(dist.irecv, flat_recv[p][a : a + P2P_SEGMENT], c.global_rank(p), c.group, tag))
    return dist.batch_isend_irecv(ops)


def _peer_communicator(group: BaguaProcessGroup, hierarchical: bool) -> BaguaCommunicator:
    """The communicator whose ranks are the peers: the node leaders when hierarchical, else the whole group."""
    return hierarchy.exchange_communicator(group, hierarchical)


# -- weights <-> flat buffers ----------------------------------------------------------------------------------


def _copy_weights_into(bucket: BaguaBucket, out: torch.Tensor) -> None:
    """Copy the bucket's current weights into the flat ``out``."""
    if bucket.flat is not None and bucket.check_flatten():
        out.copy_(bucket.flat)
        return
    offset = 0
    for t in bucket.tensors:
        out[offset : offset + t.numel()].copy_(t.effective().reshape(-1))
        offset += t.numel()


def _copy_weights_from(bucket: BaguaBucket, src: torch.Tensor, accumulate: bool = False) -> None:
    """Overwrite the bucket's weights with the flat ``src`` (with ``accumulate``: add ``src`` to them)."""
    if bucket.flat is not None and bucket.check_flatten():
        bucket.flat.add_(src) if accumulate else bucket.flat.copy_(src)
        return
    offset = 0
    for t in bucket.tensors:
        part = src[offset : offset + t.numel()].view(t.shape)
        t.effective().add_(part) if accumulate else t.effective().copy_(part)
        offset += t.numel()


def _weight_tensors(bagua_ddp) -> list[BaguaTensor]:
    """The parameters themselves (not their gradients), in reverse registration order."""
    module_name = bagua_ddp.bagua_module_name
    return [weight_tensor(p, name, module_name) for name, p in reversed(bagua_ddp.bagua_build_params())]


def _one_bucket_per_dtype(tensors: Sequence[Sequence[BaguaTensor]], do_flatten: bool) -> list[BaguaBucket]:
    by_dtype: dict[str, list[BaguaTensor]] = {}
    for t in (t for group in tensors for t in group):
        by_dtype.setdefault(str(t.dtype), []).append(t)
    return [BaguaBucket(ts, name=str(i), flatten=do_flatten) for i, (_, ts) in enumerate(sorted(by_dtype.items()))]


def _peer_count(group: BaguaProcessGroup, hierarchical: bool) -> int:
    return _peer_communicator(group, hierarchical).nranks()


# -- full precision -----------------------------------------------------------------------------------------


def _mix_all(tensor: torch.Tensor, c: BaguaCommunicator, step: int, buffers: dict) -> None:
    comm.allreduce_inplace(tensor, ReduceOp.AVG, c)


def _mix_shift_one(tensor: torch.Tensor, c: BaguaCommunicator, step: int, buffers: dict) -> None:
    peer = shift_one_peer(c.rank(), c.nranks(), step)
    received = {peer: _cached(buffers, peer, tensor)}
    for work in _start_exchange(tensor, received, c):
        work.wait()
    tensor.add_(received[peer]).div_(2)


def _mix_ring(tensor: torch.Tensor, c: BaguaCommunicator, step: int, buffers: dict) -> None:
    left, right = ring_neighbours(c.rank(), c.nranks())
    received = {p: _cached(buffers, p, tensor) for p in sorted({left, right})}
    for work in _start_exchange(tensor, received, c):
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


class DecentralizedAlgorithmImpl(AlgorithmImpl):
    """Decentralized SGD bound to a group; see :class:`DecentralizedAlgorithm`."""

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        communication_interval: int = 1,
    ) -> None:
        super().__init__(process_group)
        # user hyper-parameters
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval
        # internal state: one peer-weight buffer per bucket; rounds done (drives shift_one's pairing)
        self._peer_weight: dict[str, torch.Tensor] = {}
        self._round = 0
        self._communicating = False

    def _should_communicate(self, bagua_ddp) -> bool:
        # the engine counts the step before this hook, so step 1 (the first) communicates
        return (bagua_ddp.bagua_train_step_counter - 1) % self.communication_interval == 0

    def init_tensors(self, bagua_ddp) -> list[BaguaTensor]:
        return _weight_tensors(bagua_ddp)

    def tensors_to_buckets(self, tensors: Sequence[Sequence[BaguaTensor]], do_flatten: bool) -> list[BaguaBucket]:
        return _one_bucket_per_dtype(tensors, do_flatten)

    def init_operations(self, bagua_ddp, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        peer_weight = torch.zeros(bucket.numel + bucket.padding, dtype=bucket.dtype, device=bucket.device)
        self._peer_weight[bucket.name] = peer_weight
        mix = _MIXERS[self.peer_selection_mode]
        buffers: dict[int, torch.Tensor] = {}

        def decentralized_op(bucket: BaguaBucket, flat: torch.Tensor) -> None:
            # works on the snapshot taken before forward, so the live weights are only read by forward/backward
            step = self._round
            hierarchy.run_hierarchically(
                self.process_group, self.hierarchical, peer_weight, lambda t, c: mix(t, c, step, buffers)
            )

        bucket.append_op(decentralized_op)

    def init_forward_pre_hook(self, bagua_ddp) -> Callable[[Any], None]:
        def hook(inputs: Any) -> None:
            # a previous forward without backward may have left an exchange in flight: let it finish first
            bagua_ddp.wait_pending_comm_ops()
            self._communicating = self._should_communicate(bagua_ddp)
            if not self._communicating:
                return
            for bucket in bagua_ddp.bagua_buckets:
                _copy_weights_into(bucket, self._peer_weight[bucket.name])
            for bucket in bagua_ddp.bagua_buckets:
                bagua_ddp.mark_bucket_ready(bucket)

        return hook

    def init_backward_hook(self, bagua_ddp) -> Callable[[str, torch.Tensor], None]:
        return lambda name, param: None

    def init_post_backward_hook(self, bagua_ddp) -> Callable[[], None]:
        def hook() -> None:
            if self._communicating:
                bagua_ddp.wait_pending_comm_ops()
                with torch.no_grad():
                    for bucket in bagua_ddp.bagua_buckets:
                        _copy_weights_from(bucket, self._peer_weight[bucket.name])
                self._communicating = False
                self._round += 1
            # gradients stay local: every rank learns whether some rank's are not finite (GradScaler skips alike)
            agree_on_finite_gradients(bagua_ddp)

        return hook

    def accepts_hierarchical(self, hierarchical: bool) -> bool:
        n = _peer_count(self.process_group, hierarchical)
        return not (self.peer_selection_mode == "shift_one" and n > 1 and n % 2)

    def state_dict(self) -> dict[str, torch.Tensor]:
        # the ranks' weights differ (checkpointed per rank); the round number drives shift_one's pairing
        return {"round": torch.tensor(self._round, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._round = int(state["round"])


def _check_peer_mode(peer_selection_mode: str) -> None:
    check_choice("DecentralizedAlgorithm", "peer_selection_mode", peer_selection_mode, PEER_SELECTION_MODES)


def _check_interval(
    communication_interval: int, hierarchical: bool = True, owner: str = "DecentralizedAlgorithm"
) -> None:
    check_bool(owner, "hierarchical", hierarchical)
    check_int(owner, "communication_interval", communication_interval, 1, "communicate every that many steps")


@GlobalAlgorithmRegistry.register("decentralized", description="decentralized SGD: average weights with peers")
@dataclass
class DecentralizedAlgorithm(Algorithm):
    """Average weights with peers every ``communication_interval`` steps (D-PSGD).

    Steps of a communicating iteration:

    1. before forward, snapshot the weights and start the peer exchange on the communication thread;
    2. forward and backward run at the snapshot's weights, overlapping the exchange;
    3. after backward, wait for the exchange and overwrite the weights with the peer average;
    4. ``optimizer.step()`` applies the gradient of step 2 to the averaged weights.

    Args:
        hierarchical: average inside each node first and exchange among node leaders (then the peers of
            ``shift_one`` and ``ring`` are nodes).
        peer_selection_mode: ``"all"`` (global average), ``"shift_one"`` (one peer per round; needs an even
            number of peers) or ``"ring"`` (left and right neighbours, 1/3 each).
        communication_interval: communicate every that many steps.

    Example:
        >>> from bagua.torch_api.algorithms import decentralized
        >>> algorithm = decentralized.DecentralizedAlgorithm(peer_selection_mode="shift_one")
        >>> model = model.with_bagua([optimizer], algorithm)  # doctest: +SKIP
    """

    hierarchical: bool = True
    peer_selection_mode: str = "all"
    communication_interval: int = 1

    def __post_init__(self) -> None:
        _check_peer_mode(self.peer_selection_mode)
        _check_interval(self.communication_interval, self.hierarchical)

    def reify(self, process_group: BaguaProcessGroup) -> DecentralizedAlgorithmImpl:
        n = _peer_count(process_group, self.hierarchical)
        if self.peer_selection_mode == "shift_one" and n > 1 and n % 2:
            what = "nodes (hierarchical=True exchanges among node leaders)" if (
                self.hierarchical and process_group.is_hierarchical_possible()
            ) else "ranks"
            raise ValueError(
                f"peer_selection_mode='shift_one' pairs peers and needs an even number of them, got {n} {what}; "
                "use an even number of ranks/nodes, peer_selection_mode='all' or 'ring'"
                + (", or hierarchical=False" if what.startswith("nodes") else "")
            )
        return DecentralizedAlgorithmImpl(
            process_group,
            hierarchical=self.hierarchical,
            peer_selection_mode=self.peer_selection_mode,
            communication_interval=self.communication_interval,
        )


# The low-precision variant lives in its own module; its names stay importable from here, as in the original.
from bagua.torch_api.algorithms.low_precision_decentralized import (  # noqa: E402
    LowPrecisionDecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithmImpl,
)
