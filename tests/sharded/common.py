"""The model and data every sharded-replica test trains (2 replicas x 2 shards on gloo)."""

from __future__ import annotations

import torch

__all__ = ["model", "batch"]


def model() -> torch.nn.Module:
    """Four equal layers: the unsharded model's fragments of equal bytes end at layer (FSDP2 unit) boundaries."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: 4 samples, the same on every run."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
