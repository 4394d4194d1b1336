"""MoE: a mixture-of-experts layer with its experts spread over the ranks (expert parallelism).

With ``W`` ranks and ``num_local_experts = L``, there are ``E = W * L`` experts; expert ``e`` lives on rank
``e // L`` as its local expert ``e % L``. One forward on every rank:

1. gate the rank's ``S`` tokens (:class:`~.gating.TopKGate`): each token gets a slot in one or two experts;
2. dispatch: gather the tokens into an ``(E, C, d)`` buffer of expert slots;
3. all-to-all: rank ``r`` receives, from every rank, the slots of its own ``L`` experts;
4. each local expert runs on the slots it received from all ranks;
5. all-to-all back, then combine: each token's output is the gate-weighted sum of its experts' outputs (zero for
   a dropped token).

The backward runs the same two all-to-alls in reverse. Every rank must give the layer the same number of tokens
(the all-to-all exchanges equal shares). Expert parameters carry ``param.expert = True``: data-parallel training
leaves them out of its averaging, as each rank holds different experts; the gate is an ordinary parameter.

Example:
    >>> moe = MoE(16, torch.nn.Linear(16, 16), num_local_experts=2, k=1)  # doctest: +SKIP
    >>> out, l_aux, exp_counts = moe(torch.randn(4, 8, 16))  # doctest: +SKIP
    >>> loss = task_loss(out) + 0.01 * l_aux  # doctest: +SKIP
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.comm.lifecycle import torch_group_of
from bagua.torch_api.model_parallel.moe.gating import NOISY_GATE_POLICIES, TopKGate

__all__ = ["MoE", "MOELayer", "Experts"]


class Experts(torch.nn.Module):
    """``num_local_experts`` copies of ``expert`` (``bagua_experts``), their parameters marked ``expert = True``.

    Example:
        >>> experts = Experts(torch.nn.Linear(4, 4), num_local_experts=2)
        >>> all(p.expert for p in experts.parameters())
        True
    """

    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.bagua_experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        for p in self.bagua_experts.parameters():
            p.expert = True

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Run local expert ``j`` on ``inputs[:, j]`` of ``(ranks, num_local_experts, C, d)`` slots."""
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.bagua_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its gradient is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, _AllToAll.apply(ctx.group, grad)


class MOELayer(torch.nn.Module):
    """Gate, dispatch, all-to-all, experts, all-to-all, combine (see the module docstring).

    Args:
        gate: the :class:`~.gating.TopKGate`.
        experts: the rank's :class:`Experts`.
        num_local_experts: experts per rank.
        group: the torch group experts are spread over (``None``: this process holds them all).
    """

    def __init__(self, gate: TopKGate, experts: Experts, num_local_experts: int,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_local_experts = num_local_experts
        self.group = group
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None or dist.get_world_size(self.group) == 1:
            return x
        return _AllToAll.apply(self.group, x)

    def forward(self, input: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Return the combined expert outputs for ``input`` of shape ``(..., d)``; set ``l_aux``, ``exp_counts``."""
        d = input.shape[-1]
        tokens = input.reshape(-1, d)
        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(tokens, used_token)
        num_experts, capacity = dispatch_mask.shape[1], dispatch_mask.shape[2]
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.to(tokens.dtype), tokens)
        received = self._exchange(dispatched)
        ranks = num_experts // self.num_local_experts
        expert_out = self.experts(received.reshape(ranks, self.num_local_experts, capacity, d))
        returned = self._exchange(expert_out.reshape(num_experts, capacity, -1))
        combined = torch.einsum("sec,ecm->sm", combine_weights.to(returned.dtype), returned)
        return combined.reshape(input.shape[:-1] + (-1,))


class MoE(torch.nn.Module):
    """A mixture-of-experts layer, experts spread over the ranks of ``process_group``; the original's signature.

    Args:
        hidden_size: token dimension (input and output of every expert).
        expert: the expert module; each rank holds ``num_local_experts`` copies of it.
        num_local_experts: experts per rank; the layer has ``num_local_experts * world_size`` experts.
        k: 1 (top-1, Switch) or 2 (top-2, GShard) gating.
        output_dropout_prob: dropout on the layer's output.
        capacity_factor: expert capacity relative to an even split of the tokens, in training.
        eval_capacity_factor: the same in eval mode.
        min_capacity: the least number of slots per expert.
        noisy_gate_policy: ``None``/``"None"``, ``"Jitter"`` or ``"RSample"`` (see :mod:`.gating`).
        process_group: a torch ``ProcessGroup`` or ``BaguaProcessGroup`` to spread experts over; ``None`` for Bagua's
            default group (the torch world when only ``torch.distributed`` is initialized; this process alone when
            neither is).

    Returns (of ``forward(hidden_states, used_token=None)``):
        ``(output, l_aux, exp_counts)``: the output (shape of the input), the load-balancing loss to add (scaled)
        to the training loss, and the first choices per expert of this rank's tokens.

    Example:
        >>> moe = MoE(8, torch.nn.Linear(8, 8), num_local_experts=2)
        >>> out, l_aux, counts = moe(torch.randn(3, 5, 8))
        >>> out.shape, int(counts.sum())
        (torch.Size([3, 5, 8]), 15)
    """

    def __init__(
        self,
        hidden_size: int,
        expert: torch.nn.Module,
        num_local_experts: int = 1,
        k: int = 1,
        output_dropout_prob: float = 0.0,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        noisy_gate_policy: Optional[str] = None,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        if not isinstance(expert, torch.nn.Module):
            raise ValueError(f"expert must be a torch.nn.Module, got {type(expert).__name__}")
        if hidden_size <= 0 or num_local_experts < 1:
            raise ValueError(f"hidden_size={hidden_size} and num_local_experts={num_local_experts} must be >= 1")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r}; choose one of {NOISY_GATE_POLICIES}")
        if not 0.0 <= output_dropout_prob < 1.0:
            raise ValueError(f"output_dropout_prob={output_dropout_prob} must be in [0, 1)")
        group = _resolve_group(process_group)
        world = 1 if group is None else dist.get_world_size(group)
        self.num_local_experts = num_local_experts
        self.num_experts = num_local_experts * world
        gate = TopKGate(hidden_size, self.num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy)
        self.bagua_moe = MOELayer(gate, Experts(expert, num_local_experts), num_local_experts, group)
        self.dropout = torch.nn.Dropout(output_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        """Return ``(output, l_aux, exp_counts)`` for ``hidden_states`` of shape ``(..., hidden_size)``."""
        output = self.dropout(self.bagua_moe(hidden_states, used_token))
        return output, self.bagua_moe.l_aux, self.bagua_moe.exp_counts


def _resolve_group(process_group: Any) -> Optional[dist.ProcessGroup]:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = torch_group_of(process_group)
    if group is None:
        raise ValueError("this rank is not a member of the MoE's process_group; every rank of it must build the layer")
    return group
