"""Small models and data shared by the engine tests."""

from __future__ import annotations

import torch


class Net(torch.nn.Module):
    """An MLP with an optional branch that only some ranks (or none) use."""

    def __init__(self, unused_branch: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(10, 32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.fc3 = torch.nn.Linear(32, 4)
        self.side = torch.nn.Linear(32, 4) if unused_branch else None

    def forward(self, x: torch.Tensor, use_side: bool = False) -> torch.Tensor:
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        out = self.fc3(h)
        if use_side and self.side is not None:
            out = out + self.side(h)
        return out


def make_model(rank: int, unused_branch: bool = False) -> Net:
    """A model whose initial weights differ on every rank (so the wrap-time broadcast is exercised)."""
    torch.manual_seed(1000 + rank)
    return Net(unused_branch)


def batch(rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-dependent data."""
    g = torch.Generator().manual_seed(rank * 7919 + step)
    return torch.randn(n, 10, generator=g), torch.randn(n, 4, generator=g)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """Detached copies of the parameters."""
    return [p.detach().clone() for p in model.parameters()]
