"""A tiny regression LightningModule, its data, and the same training as a hand-written loop.

Every run builds the network right after seeding with :data:`SEED`, so a Lightning run and a plain-torch loop
start from the same weights; the data is a fixed tensor dataset that Lightning's ``DistributedSampler`` and
:func:`rank_loader` split and shuffle identically.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 0
N_TRAIN = 32
BATCH = 4


def make_net() -> torch.nn.Module:
    """The network, built from the current torch seed."""
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def train_data() -> TensorDataset:
    """32 fixed samples: 4 batches of 4 per rank and epoch on 2 ranks."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_TRAIN, 6, generator=g)
    return TensorDataset(x, x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(N_TRAIN, 1, generator=g))


def val_data() -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    return TensorDataset(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g))


def rank_loader(dataset: TensorDataset, rank: int, world_size: int) -> DataLoader:
    """This rank's share of ``dataset`` as Lightning gives it for training: a ``DistributedSampler`` that shuffles
    with seed :data:`SEED` (call ``loader.sampler.set_epoch(epoch)`` every epoch, as Lightning does)."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def make_optimizer(kind: str, params: Any, lr: float, warmup_steps: int = 3) -> torch.optim.Optimizer:
    """``"sgd"`` (momentum 0.9), ``"adam"`` or ``"qadam"`` (Bagua's QAdamOptimizer)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    if kind == "qadam":
        from bagua.torch_api.algorithms.q_adam import QAdamOptimizer

        return QAdamOptimizer(params, lr=lr, warmup_steps=warmup_steps)
    raise ValueError(f"unknown optimizer kind {kind!r}")


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Halve the learning rate every 3 steps."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


class Regression(pl.LightningModule):
    """MSE regression with one optimizer.

    Args:
        optimizer: see :func:`make_optimizer`.
        lr: learning rate.
        scheduler: add :func:`make_scheduler`, stepped every optimizer step.
        manual: manual optimization, accumulating ``accumulate`` batches with ``toggle_model(sync_grad=...)``.
        accumulate: batches per optimizer step in manual optimization.
    """

    def __init__(
        self, optimizer: str = "sgd", lr: float = 0.05, scheduler: bool = False, manual: bool = False, accumulate: int = 1
    ) -> None:
        super().__init__()
        self.net = make_net()
        self.optimizer_kind = optimizer
        self.lr = lr
        self.use_scheduler = scheduler
        self.automatic_optimization = not manual
        self.accumulate = accumulate
        #: require_backward_grad_sync of the wrapped model at each manual backward
        self.sync_flags: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        last = (batch_idx + 1) % self.accumulate == 0
        with opt.toggle_model(sync_grad=last):
            self.sync_flags.append(self.trainer.strategy.model.require_backward_grad_sync)
            self.manual_backward(loss / self.accumulate)
        if last:
            opt.step()
            opt.zero_grad()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = make_optimizer(self.optimizer_kind, self.parameters(), self.lr)
        if not self.use_scheduler:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": make_scheduler(opt), "interval": "step"}}


class RecordSync(pl.Callback):
    """Record the wrapped model's ``require_backward_grad_sync`` before every automatic backward."""

    def __init__(self) -> None:
        self.flags: list[bool] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.flags.append(bool(getattr(trainer.strategy.model, "require_backward_grad_sync", True)))
