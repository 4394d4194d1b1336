"""A user's training script that imports nothing from Bagua: ``strategy="bagua"`` must resolve by itself.

Run as ``python _user_script.py OUT_PREFIX``; Lightning re-runs it for rank 1 (its ``popen`` launcher). Each rank
writes its final weights and the strategy's class to ``OUT_PREFIX.<rank>``.
"""

import os
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g))
    model = Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="bagua",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    strategy = type(trainer.strategy)
    torch.save(
        {
            "strategy": f"{strategy.__module__}.{strategy.__qualname__}",
            "world_size": trainer.world_size,
            "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
            "weights": [p.detach().clone() for p in model.parameters()],
        },
        f"{sys.argv[1]}.{trainer.global_rank}",
    )
