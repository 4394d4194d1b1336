"""Hierarchical communication, written once for every algorithm.

*Hierarchical* (when some node holds several of a group's ranks): reduce inside each node to the node's leader,
run the algorithm's exchange among the leaders only (the slow inter-node network carries one copy per node),
broadcast the result from the leader inside each node. The leader of a node is rank 0 of its intra-node
communicator (see :mod:`bagua.torch_api.comm.process_group`), so the three steps always meet the same ranks, for any
subgroup. With one rank per node, the exchange runs over the whole group (the flat form).

On a single node of several ranks, as in the original, hierarchical mode is the node average: the leader is alone
in its exchange, which is then the algorithm's maths for one member. For averaging exchanges (allreduce, ByteGrad,
decentralized SGD) that is nothing, so every rank ends with the exact node average; low-precision decentralized SGD
still runs its 8-bit update of the leader's replicas (``x̂ += D(Q(x - x̂))``, see
:class:`~bagua.torch_api.ops.decentralized.LowPrecisionDecentralizedOp`). The original also quantized ByteGrad's
average twice on a lone leader; here it stays exact, since nothing crosses a network.

Example:
    >>> run_hierarchically(group, True, flat, lambda t, c: comm.allreduce_inplace(t, ReduceOp.AVG, c))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from bagua.torch_api.comm import collectives as comm
from bagua.torch_api.comm.reduce_op import ReduceOp
from bagua.torch_api.comm.process_group import BaguaCommunicator, BaguaProcessGroup

__all__ = ["is_hierarchical", "exchange_communicator", "reduce_to_leaders", "broadcast_from_leaders",
           "run_hierarchically", "log_if_one_node"]

logger = logging.getLogger(__name__)

Exchange = Callable[[torch.Tensor, BaguaCommunicator], None]


def is_hierarchical(group: BaguaProcessGroup, hierarchical: bool) -> bool:
    """Whether ``hierarchical`` applies to ``group`` (several of its ranks on some node)."""
    return hierarchical and group.is_hierarchical_possible()


def log_if_one_node(group: BaguaProcessGroup, hierarchical: bool, algorithm: str) -> None:
    """Warn (on the group's first rank) that a decentralized ``algorithm`` trains the node average: hierarchical
    mode on a single node, where the leader has no peer."""
    if is_hierarchical(group, hierarchical) and len(group.node_leaders()) == 1 and group.rank() == 0:
        logger.warning(
            "%s with hierarchical=True on one node of %d ranks: the ranks average inside the node and have no peer "
            "to exchange with (the original's behaviour); pass hierarchical=False for peer exchange between them",
            algorithm, group.size(),
        )


def exchange_communicator(group: BaguaProcessGroup, hierarchical: bool) -> BaguaCommunicator:
    """The communicator the exchange runs on: the node leaders when hierarchical, else the whole group."""
    if is_hierarchical(group, hierarchical):
        return group.get_inter_node_communicator()
    return group.get_global_communicator()


def reduce_to_leaders(group: BaguaProcessGroup, tensor: torch.Tensor, average: bool = True) -> None:
    """Step 1: reduce ``tensor`` (average or sum) inside each node into the node's leader."""
    comm.reduce_inplace(tensor, 0, ReduceOp.AVG if average else ReduceOp.SUM, group.get_intra_node_communicator())


def broadcast_from_leaders(group: BaguaProcessGroup, tensor: torch.Tensor) -> None:
    """Step 3: broadcast ``tensor`` from each node's leader to the node's other ranks."""
    comm.broadcast(tensor, 0, group.get_intra_node_communicator())


def run_hierarchically(
    group: BaguaProcessGroup, hierarchical: bool, tensor: torch.Tensor, exchange: Exchange, average: bool = True
) -> None:
    """Run ``exchange(tensor, communicator)``; hierarchically: node reduce, exchange among leaders, broadcast.

    ``exchange`` is only called on a member of a communicator of more than one rank (there is nothing to
    exchange otherwise). ``average`` chooses the node reduction (average or sum).
    """
    c = exchange_communicator(group, hierarchical)
    if not is_hierarchical(group, hierarchical):
        if c.is_member() and c.nranks() > 1:
            exchange(tensor, c)
        return
    reduce_to_leaders(group, tensor, average)
    if c.is_member() and c.nranks() > 1:
        exchange(tensor, c)
    broadcast_from_leaders(group, tensor)
