"""A small ResNet with BatchNorm for scikit-learn's 8x8 digits, and the digits data.

The network (He et al., 2016, https://arxiv.org/abs/1512.03385, CIFAR-style, written for this benchmark): a 3x3
stem, then stages of basic residual blocks (``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``), the width
doubling and the 8x8 image halving at each stage after the first, global average pooling and a linear layer.
The default (widths 32, 64; two blocks per stage) has 0.17 M parameters; ``tiny`` (width 8, one block per
stage) is for tests. BatchNorm keeps per-rank running statistics as buffers: DDP broadcasts rank 0's at every
forward, Bagua once at wrapping, so evaluation may differ between systems by that much.

The data: ``sklearn.datasets.load_digits`` (1797 images shipped with scikit-learn, no download), scaled to
[0, 1], split 80/20 stratified with a fixed seed.

Example:
    >>> ResNet(widths=(8, 16), blocks=1)(torch.zeros(4, 1, 8, 8)).shape
    torch.Size([4, 10])
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["BasicBlock", "ResNet", "digits_split"]


class BasicBlock(torch.nn.Module):
    """Two 3x3 conv + BatchNorm layers around a residual; a 1x1 conv + BatchNorm shortcut when the shape
    changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c_out)
        self.conv2 = torch.nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c_out)
        self.shortcut = torch.nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                                torch.nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(torch.nn.Module):
    """ResNet for (B, 1, 8, 8) images and 10 classes; ``widths`` per stage, ``blocks`` blocks per stage."""

    def __init__(self, widths: Sequence[int] = (32, 64), blocks: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        if not widths or blocks < 1:
            raise ValueError(f"a ResNet needs at least one stage and one block per stage, got widths={widths}, "
                             f"blocks={blocks}")
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(1, widths[0], 3, padding=1, bias=False),
                                        torch.nn.BatchNorm2d(widths[0]), torch.nn.ReLU())
        layers, c_in = [], widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks):
                layers.append(BasicBlock(c_in, width, stride=2 if (i > 0 and j == 0) else 1))
                c_in = width
        self.stages = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def digits_split(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as (x_train, y_train, x_test, y_test): images (N, 1, 8, 8) in [0, 1], 20 % held out, stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return x_tr, y_tr, x_te, y_te
