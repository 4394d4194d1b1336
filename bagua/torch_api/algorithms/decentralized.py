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

*Hierarchical* (both, when some node holds several of the group's ranks): average inside each node, run the
exchange among node leaders (so the peers are nodes), broadcast the result inside each node. On one node, as in
the original, that is the node average (the leader has no peer); ``hierarchical=False`` runs the peer exchange
between the node's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch
from bagua.torch_api.comm import hierarchy
from bagua.torch_api.algorithms.checks import check_choice
from bagua.torch_api.algorithms._weights import _check_interval, _one_bucket_per_dtype, _weight_tensors
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms.nonfinite import agree_on_finite_gradients
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.ops.decentralized import (
    PEER_SELECTION_MODES,
    DecentralizedOp,
    copy_weights_from,
    copy_weights_into,
    peer_communicator,
    ring_neighbours,
    shift_one_peer,
    start_exchange,
)
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.tensor import BaguaTensor

__all__ = [
    "DecentralizedAlgorithm",
    "DecentralizedAlgorithmImpl",
    "LowPrecisionDecentralizedAlgorithm",
    "LowPrecisionDecentralizedAlgorithmImpl",
    "PEER_SELECTION_MODES",
    "shift_one_peer",
    "ring_neighbours",
]

# The communication lives in bagua.torch_api.ops.decentralized (shared with the bucket's op appenders); the old
# private names stay importable from here.
_start_exchange = start_exchange
_peer_communicator = peer_communicator
_copy_weights_into = copy_weights_into
_copy_weights_from = copy_weights_from


def _peer_count(group: BaguaProcessGroup, hierarchical: bool) -> int:
    return _peer_communicator(group, hierarchical).nranks()


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
        self.hierarchical, self.peer_selection_mode = hierarchical, peer_selection_mode
        self.communication_interval = communication_interval
        # internal state: one peer-weight buffer per bucket; rounds done (drives shift_one's pairing)
        self._peer_weight: dict[str, torch.Tensor] = {}
        self._ops: dict[str, DecentralizedOp] = {}
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
        # the op snapshots the weights into peer_weight, so forward and backward only read the live weights
        peer_weight = bucket.flattened_tensor()
        self._peer_weight[bucket.name] = peer_weight
        op = bucket.append_decentralized_synchronous_op(
            peer_weight, self.hierarchical, self.peer_selection_mode, group=self.process_group
        )
        op.step = self._round  # shift_one's pairing goes on from the last round after a re-initialization
        self._ops[bucket.name] = op

    def init_forward_pre_hook(self, bagua_ddp) -> Callable[[Any], None]:
        def hook(inputs: Any) -> None:
            # a previous forward without backward may have left an exchange in flight: let it finish first
            bagua_ddp.wait_pending_comm_ops()
            self._communicating = self._should_communicate(bagua_ddp)
            if not self._communicating:
                return
            for bucket in bagua_ddp.bagua_buckets:
                bagua_ddp.mark_bucket_ready(bucket)

        return hook

    def init_backward_hook(self, bagua_ddp) -> Callable[[str, torch.Tensor], None]:
        return lambda name, param: None

    def init_post_backward_hook(self, bagua_ddp) -> Callable[[], None]:
        def hook() -> None:
            if self._communicating:
                bagua_ddp.wait_pending_comm_ops()
                for bucket in bagua_ddp.bagua_buckets:
                    self._ops[bucket.name].copy_back_peer_weight(bucket)
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
        for op in self._ops.values():  # ops built at wrap time go on from the restored round
            op.step = self._round


def _check_peer_mode(peer_selection_mode: str) -> None:
    check_choice("DecentralizedAlgorithm", "peer_selection_mode", peer_selection_mode, PEER_SELECTION_MODES)


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

    replica_refusal: ClassVar[str] = ("its peers exchange whole weights every step, with a peer chosen per step; "
                                   "use DiLoCoAlgorithm, which also sends weights, every sync_every steps")

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
        hierarchy.log_if_one_node(process_group, self.hierarchical, "DecentralizedAlgorithm")
        return DecentralizedAlgorithmImpl(process_group, **self.hyperparameters())


# The low-precision variant lives in its own module; its names stay importable from here, as in the original.
from bagua.torch_api.algorithms.low_precision_decentralized import (  # noqa: E402
    LowPrecisionDecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithmImpl,
)
