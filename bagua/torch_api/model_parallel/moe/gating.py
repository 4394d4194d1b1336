"""Top-1 and top-2 gating with expert capacity, as pure functions of the gate logits.

Each token goes to its best expert (top-1, Switch Transformer, https://arxiv.org/abs/2101.03961) or its two best
(top-2, GShard, https://arxiv.org/abs/2006.16668). An expert takes at most ``capacity`` tokens per step and rank,
``capacity = max(min_capacity, ceil(k * tokens / experts * capacity_factor))``; tokens beyond it, in token order
(for top-2: all first choices before any second choice), are dropped, i.e. contribute zero. The gate functions
return

- ``l_aux``: the load-balancing loss ``E * sum_e(mean gate prob of e * fraction of tokens whose first choice is e)``,
- ``combine_weights`` ``(S, E, C)``: the weight of token ``s`` in slot ``c`` of expert ``e`` (the gate
  probability; top-2 renormalizes the two kept probabilities to sum to 1),
- ``dispatch_mask`` ``(S, E, C)``: where each token is sent,
- ``exp_counts`` ``(E,)``: first choices per expert before dropping, on the CPU.

Noise (training only): ``"Jitter"`` multiplies the gate input by ``U(1 - 1e-2, 1 + 1e-2)`` (Switch Transformer);
``"RSample"`` adds Gumbel noise to the logits that choose the experts (the probabilities stay noise-free).
Without noise the choice is deterministic: unlike DeepSpeed's (and the original's) top-2, which always draws
the second expert with Gumbel noise, the second expert is the second-best one unless ``"RSample"`` is set.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["top1gating", "top2gating", "TopKGate", "NOISY_GATE_POLICIES", "Gating"]

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
_JITTER_EPS = 1e-2
#: What the gate functions return: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``.
Gating = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    return max(int(min_capacity), math.ceil(num_tokens / num_experts * capacity_factor))


def _gumbel_like(logits: torch.Tensor) -> torch.Tensor:
    u = torch.rand_like(logits).clamp(1e-9, 1 - 1e-9)
    return -torch.log(-torch.log(u))


def _slots(mask: torch.Tensor, locations: torch.Tensor, capacity: int) -> torch.Tensor:
    """``(S, E, C)`` one-hot of each kept token's slot in its expert."""
    loc = (locations * mask).sum(dim=1)
    return mask.unsqueeze(2) * F.one_hot(loc, capacity).unsqueeze(1)


def _choices(
    logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, used_token: Optional[torch.Tensor],
    noisy_gate_policy: Optional[str],
) -> tuple[torch.Tensor, int, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The gate probabilities, the capacity, each token's ``k`` choices as one-hot ``(S, E)`` masks (best first,
    ``used_token`` applied), the first choices per expert and ``l_aux``: what top-1 and top-2 share."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = _capacity(num_tokens, num_experts, k * capacity_factor, min_capacity)
    # Without noise top-1 chooses on the probabilities and top-2 on the logits: the same order but where softmax
    # rounds two logits to one probability; each keeps its own, so that routing stays as it was.
    choose = logits + _gumbel_like(logits) if noisy_gate_policy == "RSample" else (gates if k == 1 else logits)
    masks = [F.one_hot(choose.argmax(dim=1), num_experts)]
    if k == 2:
        masks.append(F.one_hot(choose.masked_fill(masks[0].bool(), float("-inf")).argmax(dim=1), num_experts))
    if used_token is not None:
        keep = used_token.reshape(-1, 1).to(masks[0].dtype)
        masks = [m * keep for m in masks]
    exp_counts = masks[0].sum(dim=0).detach().cpu()
    l_aux = (gates.mean(dim=0) * masks[0].float().mean(dim=0)).sum() * num_experts
    return gates, capacity, masks, exp_counts, l_aux


def top1gating(
    logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: Optional[torch.Tensor] = None,
    noisy_gate_policy: Optional[str] = None,
) -> Gating:
    """Route each of the ``S`` tokens to its best of ``E`` experts (see the module docstring).

    Args:
        logits: ``(S, E)`` gate logits.
        capacity_factor: slots per expert relative to an even split of the tokens.
        min_capacity: the least number of slots per expert.
        used_token: optional ``(S,)`` 0/1 mask; tokens with 0 go nowhere.
        noisy_gate_policy: ``"RSample"`` chooses with Gumbel noise; anything else without.

    Returns:
        ``(l_aux, combine_weights, dispatch_mask, exp_counts)``.

    Example:
        >>> l_aux, combine, dispatch, counts = top1gating(torch.randn(8, 4), 1.0, 1)
        >>> combine.shape, counts.sum().item()
        (torch.Size([8, 4, 2]), 8)
    """
    gates, capacity, (mask,), exp_counts, l_aux = _choices(logits, 1, capacity_factor, min_capacity, used_token,
                                                           noisy_gate_policy)
    locations = torch.cumsum(mask, dim=0) - 1
    mask = mask * (locations < capacity)
    slots = _slots(mask, locations, capacity)
    gate_s = (gates * mask).sum(dim=1)
    combine_weights = gate_s.reshape(-1, 1, 1) * slots
    return l_aux, combine_weights, slots.bool(), exp_counts


def top2gating(
    logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: Optional[torch.Tensor] = None,
    noisy_gate_policy: Optional[str] = None,
) -> Gating:
    """Route each token to its two best experts (see the module docstring); arguments as :func:`top1gating`.

    Example:
        >>> l_aux, combine, dispatch, counts = top2gating(torch.randn(8, 4), 1.0, 1)
        >>> torch.allclose(combine.sum(dim=(1, 2))[combine.sum(dim=(1, 2)) > 0], torch.tensor(1.0))
        True
    """
    gates, capacity, (mask1, mask2), exp_counts, l_aux = _choices(logits, 2, capacity_factor, min_capacity,
                                                                  used_token, noisy_gate_policy)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # second choices queue behind
    mask1 = mask1 * (locations1 < capacity)
    mask2 = mask2 * (locations2 < capacity)
    slots1, slots2 = _slots(mask1, locations1, capacity), _slots(mask2, locations2, capacity)
    gate1, gate2 = (gates * mask1).sum(dim=1), (gates * mask2).sum(dim=1)
    denom = (gate1 + gate2).clamp(min=torch.finfo(gates.dtype).eps)
    combine_weights = (gate1 / denom).reshape(-1, 1, 1) * slots1 + (gate2 / denom).reshape(-1, 1, 1) * slots2
    return l_aux, combine_weights, (slots1 + slots2).bool(), exp_counts


class TopKGate(torch.nn.Module):
    """A linear gate ``wg`` (no bias) followed by top-1 or top-2 gating; computed in float32.

    Args:
        model_dim: token dimension.
        num_experts: total number of experts (all ranks).
        k: 1 or 2.
        capacity_factor: capacity factor in training.
        eval_capacity_factor: capacity factor in eval mode.
        min_capacity: the least number of slots per expert.
        noisy_gate_policy: ``None``, ``"None"``, ``"Jitter"`` or ``"RSample"`` (applied in training only).

    Example:
        >>> gate = TopKGate(16, 4, k=2)
        >>> gate(torch.randn(10, 16))[1].shape
        torch.Size([10, 4, 5])
    """

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 noisy_gate_policy: Optional[str] = None) -> None:
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"k={k}: only top-1 and top-2 gating are supported")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r}; choose one of {NOISY_GATE_POLICIES}")
        if capacity_factor <= 0 or eval_capacity_factor <= 0 or min_capacity < 0:
            raise ValueError("capacity_factor and eval_capacity_factor must be > 0 and min_capacity >= 0, got "
                             f"{capacity_factor}, {eval_capacity_factor}, {min_capacity}")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy

    def forward(self, input: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        """Gate ``(S, model_dim)`` tokens; return ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
        x = input.float()
        policy = self.noisy_gate_policy if self.training else None
        if policy == "Jitter":
            x = x * torch.empty_like(x).uniform_(1.0 - _JITTER_EPS, 1.0 + _JITTER_EPS)
        logits = F.linear(x, self.wg.weight.float())  # float32 even when the model was cast to half
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        gating = top1gating if self.k == 1 else top2gating
        return gating(logits, factor, self.min_capacity, used_token, policy)
