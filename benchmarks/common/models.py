"""The benchmark models and their data (:data:`MODELS`), selected by ``--models`` / ``--model``.

- ``mlp``: a communication-heavy MLP (25.2 M parameters) on a fixed pool of synthetic batches, MSE, SGD;
- ``digits``: a small CNN, and ``resnet``: a BatchNorm ResNet (:mod:`benchmarks.common.resnet`), on scikit-learn's
  digits (a ``DistributedSampler`` over the 80 % training split), cross-entropy, Adam, test accuracy;
- ``gpt``: a byte-level GPT (:mod:`benchmarks.common.gpt`) on the standard library's sources, next-byte
  cross-entropy, Adam, validation loss;
- ``tiny``, ``resnet_tiny``, ``gpt_tiny``: the same kinds at test sizes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

__all__ = ["ModelSpec", "MODELS", "DigitsCNN", "build_model", "digits_epoch_batches", "train_batches", "loss_fn"]

class DigitsCNN(torch.nn.Module):
    """A small CNN for 8x8 digits: conv 32, conv 64, pool, 256, 10 (about 0.28 M parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        )
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64 * 4 * 4, 256), torch.nn.ReLU(),
                                        torch.nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _mlp(widths: Sequence[int]) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


@dataclass
class ModelSpec:
    """A benchmark model: how to build it, its input, and its data (``synthetic``: fixed random batches, MSE,
    SGD; ``digits``: scikit-learn's digits, cross-entropy, Adam, test accuracy; ``text``: the standard library's
    sources as bytes, next-byte cross-entropy, Adam, validation loss)."""

    build: Callable[[], torch.nn.Module]
    in_shape: tuple[int, ...]
    out_dim: int
    classify: bool
    description: str
    data: str = "synthetic"
    batch_size: int = 32

    @property
    def optimizer(self) -> str:
        return "sgd" if self.data == "synthetic" else "adam"

    @property
    def lr(self) -> float:
        return {"synthetic": 0.01, "digits": 0.002, "text": 0.001}[self.data]


def _gpt(tiny: bool) -> torch.nn.Module:
    from benchmarks.common.gpt import GPT, GPTConfig

    return GPT(GPTConfig.tiny() if tiny else GPTConfig())


def _resnet(tiny: bool) -> torch.nn.Module:
    from benchmarks.common.resnet import ResNet

    return ResNet((8, 16), blocks=1) if tiny else ResNet()


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(lambda: _mlp([1024, 4096, 4096, 1024]), (1024,), 1024, False,
                     "comm-heavy MLP 1024-4096-4096-1024 (25.2 M params, 100.7 MB fp32), synthetic data, MSE, SGD"),
    "digits": ModelSpec(DigitsCNN, (1, 8, 8), 10, True,
                        "small CNN on sklearn digits (0.28 M params), cross-entropy, Adam; reports test accuracy",
                        data="digits"),
    "resnet": ModelSpec(lambda: _resnet(False), (1, 8, 8), 10, True,
                        "ResNet with BatchNorm on sklearn digits (0.17 M params), cross-entropy, Adam; "
                        "reports test accuracy", data="digits"),
    "gpt": ModelSpec(lambda: _gpt(False), (128,), 256, False,
                     "GPT byte-level LM, 6 layers x 384, tied embeddings (10.8 M params), Python stdlib text, "
                     "Adam, batch 8 x 128 tokens; reports validation loss", data="text", batch_size=8),
    "tiny": ModelSpec(lambda: _mlp([32, 64, 32]), (32,), 32, False, "tiny MLP for tests (4.2 K params)"),
    "resnet_tiny": ModelSpec(lambda: _resnet(True), (1, 8, 8), 10, True, "tiny ResNet for tests", data="digits"),
    "gpt_tiny": ModelSpec(lambda: _gpt(True), (16,), 256, False, "tiny GPT for tests (34 K params)",
                          data="text", batch_size=4),
}


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """Build the benchmark model ``name`` with weights drawn from ``seed``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    torch.manual_seed(seed)
    return MODELS[name].build()


def _digits_split(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from benchmarks.common.resnet import digits_split

    return digits_split(seed)


def _text(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (train, validation) byte streams of a text model (smaller caps for the tiny one)."""
    from benchmarks.common.gpt import load_text

    return load_text(1 << 20, 256 << 10) if model.endswith("_tiny") else load_text()


def digits_epoch_batches(x_tr: torch.Tensor, y_tr: torch.Tensor, batch_size: int, rank: int, world: int,
                         seed: int, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of this rank's digits batches (``DistributedSampler``, shuffled by epoch, last batch dropped)."""
    sampler = torch.utils.data.DistributedSampler(range(len(x_tr)), num_replicas=world, rank=rank, shuffle=True,
                                                  seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    idx = torch.tensor(list(sampler))
    return [(x_tr[idx[s:s + batch_size]], y_tr[idx[s:s + batch_size]])
            for s in range(0, len(idx) - batch_size + 1, batch_size)]


def train_batches(args: argparse.Namespace, rank: int, world: int) -> tuple[list, Optional[tuple]]:
    """The training batches of this rank, in order (all epochs), and the test set for classifiers."""
    spec = MODELS[args.model]
    if spec.data == "synthetic":
        g = torch.Generator().manual_seed(1000 + rank)
        pool = [(torch.randn(args.batch_size, *spec.in_shape, generator=g),
                 torch.randn(args.batch_size, spec.out_dim, generator=g)) for _ in range(4)]
        return [pool[i % len(pool)] for i in range(args.warmup + args.steps)], None
    if spec.data == "text":
        from benchmarks.common.gpt import TextBatches

        stream = TextBatches(_text(args.model)[0], args.batch_size, spec.in_shape[0], args.seed, rank)
        return [stream.batch(i) for i in range(args.warmup + args.steps)], None
    x_tr, y_tr, x_te, y_te = _digits_split(args.seed)
    batches = []
    for epoch in range(args.epochs):
        batches += digits_epoch_batches(x_tr, y_tr, args.batch_size, rank, world, args.seed, epoch)
    return batches, (x_te, y_te)


def loss_fn(spec: ModelSpec) -> Callable:
    """The training loss of a model: MSE (synthetic), cross-entropy (digits), next-byte cross-entropy (text)."""
    if spec.data == "text":
        from benchmarks.common.gpt import lm_loss

        return lm_loss
    return torch.nn.functional.cross_entropy if spec.classify else torch.nn.functional.mse_loss
