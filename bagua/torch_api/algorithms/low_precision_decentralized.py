"""Low-precision decentralized SGD (https://arxiv.org/abs/1803.06443): ring neighbours exchange 8-bit weight
differences after each optimizer step and keep public replicas ``x̂`` of themselves and of both neighbours, so only
one byte per weight crosses the network. See :class:`LowPrecisionDecentralizedAlgorithm` for the steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from bagua.torch_api import hierarchy
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms.decentralized import (
    _check_interval,
    _copy_weights_from,
    _peer_communicator,
    _start_exchange,
    _weight_tensors,
    ring_neighbours,
)
from bagua.torch_api.algorithms.nonfinite import agree_on_finite_gradients
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.compression import BLOCK, decode_chunks, encode_chunks, scratch_buffer, wire_buffer
from bagua.torch_api.process_group import BaguaCommunicator, BaguaProcessGroup
from bagua.torch_api.tensor import BaguaTensor

__all__ = ["LowPrecisionDecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithmImpl"]


class _Replicas:
    """Per-bucket state of low-precision decentralized SGD (flat, float32).

    Fields: ``mine`` (x̂_i, my public copy), ``left`` / ``right`` (x̂ of my ring neighbours); scratch buffers
    ``diff`` (d), ``scratch``, ``wire`` (my 8-bit message) and ``received`` (the neighbours' messages, one per
    distinct neighbour); ``works``: the exchange in flight. Buffers are allocated once: fresh model-sized
    tensors every step cost more than the arithmetic (page faults).
    """

    __slots__ = ("mine", "left", "right", "diff", "scratch", "wire", "received", "works")

    def __init__(self, x: torch.Tensor) -> None:
        xf = x.detach().float()
        self.mine = xf.clone()
        self.left = xf.clone()
        self.right = xf.clone()
        self.diff = torch.empty_like(self.mine)
        self.scratch = scratch_buffer(x.numel(), x.device)
        self.wire = wire_buffer(1, x.numel(), x.device)
        self.received: dict[int, torch.Tensor] = {}
        self.works: list[Any] = []


def _ring_round_start(x: torch.Tensor, r: _Replicas, c: BaguaCommunicator, tag: int) -> None:
    """Steps 1-3 of a round (see :class:`LowPrecisionDecentralizedAlgorithm`): ``d``, ``C = Q(d)``, send/receive."""
    xf = x if x.dtype == torch.float32 else x.float()
    # block by block, so each input is read from memory once and the three operations run in cache
    step = BLOCK if x.device.type == "cpu" else x.numel()
    for a in range(0, x.numel(), step):
        b = min(a + step, x.numel())
        d = torch.add(xf[a:b], r.left[a:b], alpha=1 / 3, out=r.diff[a:b])
        d.add_(r.right[a:b], alpha=1 / 3).sub_(r.mine[a:b], alpha=5 / 3)
    encode_chunks(r.diff.view(1, -1), r.wire, work=r.scratch)
    if not r.received:  # one buffer per distinct neighbour: with two ranks, left and right are the same rank
        r.received = {p: torch.empty_like(r.wire) for p in sorted(set(ring_neighbours(c.rank(), c.nranks())))}
    r.works = _start_exchange(r.wire, r.received, c, tag)


def _ring_round_finish(r: _Replicas, c: BaguaCommunicator) -> None:
    """Step 4 of a round: wait for the neighbours' messages and add the decoded differences to the replicas."""
    for work in r.works:
        work.wait()
    r.works = []
    left, right = ring_neighbours(c.rank(), c.nranks())
    decode_chunks(r.received[left], r.left.view(1, -1), accumulate=True, work=r.scratch)
    decode_chunks(r.received[right], r.right.view(1, -1), accumulate=True, work=r.scratch)
    decode_chunks(r.wire, r.mine.view(1, -1), accumulate=True, work=r.scratch)


class LowPrecisionDecentralizedAlgorithmImpl(AlgorithmImpl):
    """Low-precision decentralized SGD bound to a group; see :class:`LowPrecisionDecentralizedAlgorithm`."""

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = True, communication_interval: int = 1):
        super().__init__(process_group)
        # user hyper-parameters
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval
        # internal state: replicas per bucket; the bucket whose round is still in flight; the optimizers that
        # stepped in this iteration
        self._replicas: dict[str, _Replicas] = {}
        self._replica_buckets: dict[str, BaguaBucket] = {}
        self._carried: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._in_flight: Optional[BaguaBucket] = None
        self._stepped: set[int] = set()

    def _layout(self) -> tuple[bool, BaguaCommunicator]:
        """(whether to go through node leaders, the communicator of the ring)."""
        return (hierarchy.is_hierarchical(self.process_group, self.hierarchical),
                _peer_communicator(self.process_group, self.hierarchical))

    def init_tensors(self, bagua_ddp) -> list[BaguaTensor]:
        in_optimizer = {id(p) for o in bagua_ddp.bagua_optimizers for g in o.param_groups for p in g["params"]}
        missing = [name for name, p in bagua_ddp.bagua_build_params() if id(p) not in in_optimizer]
        if missing:
            raise RuntimeError(
                f"low_precision_decentralized communicates after optimizer.step(), but parameters {missing} are "
                "in no optimizer given to with_bagua; add them to an optimizer, or exclude them by listing their "
                "names in model._bagua_params_and_buffers_to_ignore"
            )
        return _weight_tensors(bagua_ddp)

    def tensors_to_buckets(self, tensors, do_flatten: bool) -> list[BaguaBucket]:
        # Re-bucketing (autotune) must not rebuild the replicas from each rank's own weights, which differ: the
        # replicas of every tensor are carried over, by tensor name, into the new buckets.
        self._finish_in_flight()
        self._carried = {}
        for name, bucket in self._replica_buckets.items():
            r, offset = self._replicas[name], 0
            for t in bucket.tensors:
                n = t.numel()
                self._carried[t.name] = (r.mine[offset : offset + n], r.left[offset : offset + n],
                                         r.right[offset : offset + n])
                offset += n
        self._replicas, self._replica_buckets = {}, {}
        return super().tensors_to_buckets(tensors, do_flatten)

    def _new_replicas(self, bucket: BaguaBucket) -> _Replicas:
        replicas = _Replicas(bucket.flattened_tensor())  # at wrap time every rank holds rank 0's weights
        if all(t.name in self._carried for t in bucket.tensors):
            for k, field in enumerate((replicas.mine, replicas.left, replicas.right)):
                field[: bucket.numel].copy_(torch.cat([self._carried[t.name][k] for t in bucket.tensors]))
        return replicas

    def init_operations(self, bagua_ddp, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        replicas = self._new_replicas(bucket)
        self._replicas[bucket.name] = replicas
        self._replica_buckets[bucket.name] = bucket
        tag = len(self._replicas) - 1

        def low_precision_decentralized_op(bucket: BaguaBucket, flat: torch.Tensor) -> None:
            # start this bucket's exchange, then finish the previous bucket's while this one is on the wire;
            # the post-step hook finishes the last one
            hierarchical, c = self._layout()
            if hierarchical:
                hierarchy.reduce_to_leaders(self.process_group, flat)
            if c.is_member() and c.nranks() > 1:
                _ring_round_start(flat, replicas, c, tag)
            self._finish_in_flight()
            self._in_flight = bucket

        bucket.append_op(low_precision_decentralized_op)

    def _finish_in_flight(self) -> None:
        bucket, self._in_flight = self._in_flight, None
        if bucket is None:
            return
        hierarchical, c = self._layout()
        replicas = self._replicas[bucket.name]
        if c.is_member() and c.nranks() > 1:
            _ring_round_finish(replicas, c)
        elif not hierarchical:
            return  # a group of one rank
        if hierarchical:
            hierarchy.broadcast_from_leaders(self.process_group, replicas.mine)
        _copy_weights_from(bucket, replicas.mine)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The replicas ``x̂`` (this rank's and its neighbours'), per tensor name (``<name>.mine/left/right``)."""
        self._finish_in_flight()
        state = {}
        for name, bucket in self._replica_buckets.items():
            r, offset = self._replicas[name], 0
            for t in bucket.tensors:
                for field in ("mine", "left", "right"):
                    state[f"{t.name}.{field}"] = getattr(r, field)[offset : offset + t.numel()].clone()
                offset += t.numel()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._finish_in_flight()
        for name, bucket in self._replica_buckets.items():
            r, offset = self._replicas[name], 0
            for t in bucket.tensors:
                for field in ("mine", "left", "right"):
                    key = f"{t.name}.{field}"
                    if key not in state:
                        raise ValueError(f"the low-precision decentralized state has no replica {key!r}; it was "
                                         "saved from another model")
                    getattr(r, field)[offset : offset + t.numel()].copy_(state[key].reshape(-1))
                offset += t.numel()

    def init_forward_pre_hook(self, bagua_ddp) -> Callable[[Any], None]:
        def hook(inputs: Any) -> None:
            self._stepped.clear()

        return hook

    def init_backward_hook(self, bagua_ddp) -> Callable[[str, torch.Tensor], None]:
        return lambda name, param: None

    def init_post_backward_hook(self, bagua_ddp) -> Callable[[], None]:
        # every rank learns whether some rank's gradients are not finite, so GradScaler skips the same steps
        # everywhere, and no rank ever waits in the post-step exchange for a neighbour that skipped its step
        return lambda: agree_on_finite_gradients(bagua_ddp)

    def init_post_optimizer_step_hook(self, bagua_ddp) -> Callable[[torch.optim.Optimizer], None]:
        def hook(optimizer: torch.optim.Optimizer) -> None:
            if (bagua_ddp.bagua_train_step_counter - 1) % self.communication_interval != 0:
                return
            # with several optimizers, communicate once all of them have stepped (by object: a fused optimizer
            # may show other tensors in param_groups while it steps)
            self._stepped.add(id(optimizer))
            if any(id(o) not in self._stepped for o in bagua_ddp.bagua_optimizers):
                return
            self._stepped.clear()
            with torch.no_grad():
                for bucket in bagua_ddp.bagua_buckets:
                    bagua_ddp.mark_bucket_ready(bucket)
                bagua_ddp.wait_pending_comm_ops()
                self._finish_in_flight()

        return hook


@GlobalAlgorithmRegistry.register(
    "low_precision_decentralized", description="decentralized SGD on a ring with 8-bit weight differences"
)
@dataclass
class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Decentralized SGD on a ring exchanging 8-bit (MinMaxUInt8) weight differences after every step.

    Each rank keeps float32 replicas ``x̂_i`` (its public copy), ``x̂_l`` and ``x̂_r`` (its ring neighbours'),
    all equal to the weights at wrap time. After ``optimizer.step()`` (every ``communication_interval`` steps),
    for each bucket, with ``x`` the stepped weights:

    1. ``d = x + x̂_l/3 + x̂_r/3 - 5/3 x̂_i`` = (local progress ``x - x̂_i``) + (ring average of replicas - x̂_i);
    2. ``C = Q(d)``: MinMaxUInt8 over the whole bucket (one chunk);
    3. send ``C`` to both neighbours, receive theirs (``C_l``, ``C_r``); the next bucket encodes meanwhile;
    4. ``x̂_l += D(C_l)``, ``x̂_r += D(C_r)``, ``x̂_i += D(C)``, ``x = x̂_i``.

    Every rank decodes the same bytes, so a rank's ``x̂_i`` and its neighbours' copies of it stay identical.
    Every parameter must belong to one of the optimizers given to ``with_bagua``.

    Args:
        hierarchical: average inside each node first and run the ring among node leaders.
        communication_interval: communicate every that many steps.

    Example:
        >>> from bagua.torch_api.algorithms import decentralized
        >>> algorithm = decentralized.LowPrecisionDecentralizedAlgorithm()
        >>> model = model.with_bagua([optimizer], algorithm)  # doctest: +SKIP
    """

    hierarchical: bool = True
    communication_interval: int = 1

    def __post_init__(self) -> None:
        _check_interval(self.communication_interval, self.hierarchical, "LowPrecisionDecentralizedAlgorithm")

    def reify(self, process_group: BaguaProcessGroup) -> LowPrecisionDecentralizedAlgorithmImpl:
        return LowPrecisionDecentralizedAlgorithmImpl(
            process_group, hierarchical=self.hierarchical, communication_interval=self.communication_interval
        )
