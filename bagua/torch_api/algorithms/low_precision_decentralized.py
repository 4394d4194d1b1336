"""Low-precision decentralized SGD (https://arxiv.org/abs/1803.06443): ring neighbours exchange 8-bit weight
differences after each optimizer step and keep public replicas ``x̂`` of themselves and of both neighbours, so only
one byte per weight crosses the network. See :class:`LowPrecisionDecentralizedAlgorithm` for the steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Optional

import torch
from bagua.torch_api.comm import hierarchy
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms._weights import _check_interval, _weight_tensors
from bagua.torch_api.algorithms.nonfinite import agree_on_finite_gradients
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.codecs.block import DEFAULT_BLOCK
from bagua.torch_api.ops.compressed import check_codec
from bagua.torch_api.ops.decentralized import LowPrecisionDecentralizedOp, Replicas
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.tensor import BaguaTensor

__all__ = ["LowPrecisionDecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithmImpl"]

_FIELDS = ("mine", "left", "right")  # the Replicas fields kept per tensor: x̂_i, x̂_l, x̂_r



class LowPrecisionDecentralizedAlgorithmImpl(AlgorithmImpl):
    """Low-precision decentralized SGD bound to a group; see :class:`LowPrecisionDecentralizedAlgorithm`."""

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = True, communication_interval: int = 1,
                 codec: str = "chunk", block_size: int = DEFAULT_BLOCK):
        super().__init__(process_group)
        # user hyper-parameters
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval
        self.codec = check_codec("LowPrecisionDecentralizedAlgorithm", codec, block_size, for_gradients=False)
        self.block_size = block_size
        # internal state: replicas per bucket; the bucket whose round is still in flight; the optimizers that
        # stepped in this iteration
        self._replicas: dict[str, Replicas] = {}
        self._replica_buckets: dict[str, BaguaBucket] = {}
        self._carried: dict[str, torch.Tensor] = {}
        self._in_flight: Optional[tuple[LowPrecisionDecentralizedOp, BaguaBucket]] = None
        self._stepped: set[int] = set()

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
        self._carried = dict(self._replica_views())
        self._replicas, self._replica_buckets = {}, {}
        return super().tensors_to_buckets(tensors, do_flatten)

    def _new_replicas(self, bucket: BaguaBucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = bucket.flattened_tensor().float()  # at wrap time every rank holds rank 0's weights
        fields = (x, x.clone(), x.clone())
        if all(f"{t.name}.mine" in self._carried for t in bucket.tensors):
            for field_name, field in zip(_FIELDS, fields):
                parts = [self._carried[f"{t.name}.{field_name}"] for t in bucket.tensors]
                field[: bucket.numel].copy_(torch.cat(parts))
        return fields

    def _replica_views(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``("<tensor name>.<mine|left|right>", view of that tensor's part of the bucket's replica)``."""
        for name, bucket in self._replica_buckets.items():
            r, offset = self._replicas[name], 0
            for t in bucket.tensors:
                for field in _FIELDS:
                    yield f"{t.name}.{field}", getattr(r, field)[offset : offset + t.numel()]
                offset += t.numel()

    def init_operations(self, bagua_ddp, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        op = bucket.append_low_precision_decentralized_synchronous_op(
            *self._new_replicas(bucket), hierarchical=self.hierarchical, group=self.process_group,
            compression=self.codec, block_size=self.block_size,
        )
        op.tag, op.pipeline = len(self._replicas), self._pipeline
        self._replicas[bucket.name] = op.replicas
        self._replica_buckets[bucket.name] = bucket

    def _pipeline(self, op: LowPrecisionDecentralizedOp, bucket: BaguaBucket) -> None:
        # this bucket's exchange is on the wire: finish the previous bucket's meanwhile; the post-step hook finishes
        # the last one
        self._finish_in_flight()
        self._in_flight = (op, bucket)

    def _finish_in_flight(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            op, bucket = in_flight
            op.finish(bucket)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The replicas ``x̂`` (this rank's and its neighbours'), per tensor name (``<name>.mine/left/right``)."""
        self._finish_in_flight()
        return {key: view.clone() for key, view in self._replica_views()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._finish_in_flight()
        for key, view in self._replica_views():
            if key not in state:
                raise ValueError(f"the low-precision decentralized state has no replica {key!r}; it was "
                                 "saved from another model")
            view.copy_(state[key].reshape(-1))

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
    """Decentralized SGD on a ring exchanging 8-bit (MinMaxUInt8, or another codec) weight differences after every
    step.

    Each rank keeps float32 replicas ``x̂_i`` (its public copy), ``x̂_l`` and ``x̂_r`` (its ring neighbours'),
    all equal to the weights at wrap time. After ``optimizer.step()`` (every ``communication_interval`` steps),
    for each bucket, with ``x`` the stepped weights:

    1. ``d = x + x̂_l/3 + x̂_r/3 - 5/3 x̂_i`` = (local progress ``x - x̂_i``) + (ring average of replicas - x̂_i);
    2. ``C = Q(d)``: MinMaxUInt8 over the whole bucket (one chunk), or the block codec ``codec``;
    3. send ``C`` to both neighbours, receive theirs (``C_l``, ``C_r``); the next bucket encodes meanwhile;
    4. ``x̂_l += D(C_l)``, ``x̂_r += D(C_r)``, ``x̂_i += D(C)``, ``x = x̂_i``.

    Every rank decodes the same bytes, so a rank's ``x̂_i`` and its neighbours' copies of it stay identical.
    Every parameter must belong to one of the optimizers given to ``with_bagua``.

    Args:
        hierarchical: average inside each node first and run the ring among node leaders (on one node the
            leader runs the 8-bit update with itself as both neighbours, as in the original).
        communication_interval: communicate every that many steps.
        codec: the code of the differences, a name of the codec registry (:mod:`~bagua.torch_api.codecs.registry`):
            ``"chunk"`` (the default and the original's: MinMaxUInt8 with one min/max for the whole bucket; alias
            ``"MinMaxUInt8"``), ``"bf16"``, ``"uint8"``, ``"uint4"``, ``"nf2"`` or ``"sign1"`` (one header per
            block of ``block_size`` elements, so that every tensor of the bucket keeps its resolution).
        block_size: elements per block of the block codecs (even).

    Example:
        >>> from bagua.torch_api.algorithms import decentralized
        >>> algorithm = decentralized.LowPrecisionDecentralizedAlgorithm()
        >>> model = model.with_bagua([optimizer], algorithm)  # doctest: +SKIP
    """

    replica_refusal: ClassVar[str] = "its ring exchanges whole weights with neighbour replicas"

    hierarchical: bool = True
    communication_interval: int = 1
    codec: str = "chunk"
    block_size: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        _check_interval(self.communication_interval, self.hierarchical, "LowPrecisionDecentralizedAlgorithm")
        self.codec = check_codec("LowPrecisionDecentralizedAlgorithm", self.codec, self.block_size,
                                 for_gradients=False)  # weight differences: any codec

    def reify(self, process_group: BaguaProcessGroup) -> LowPrecisionDecentralizedAlgorithmImpl:
        hierarchy.log_if_one_node(process_group, self.hierarchical, "LowPrecisionDecentralizedAlgorithm")
        return LowPrecisionDecentralizedAlgorithmImpl(
            process_group, hierarchical=self.hierarchical, communication_interval=self.communication_interval,
            codec=self.codec, block_size=self.block_size,
        )
