"""Bagua for PyTorch Lightning 2.x: ``BaguaStrategy`` and ``BaguaEnvironment``.

``Trainer(strategy="bagua")`` needs no import (see :mod:`bagua.lightning.registration`);
``Trainer(strategy=BaguaStrategy(algorithm="bytegrad"))`` passes options. ``BaguaStrategy`` here is built for the
``lightning`` package when it is installed, else for ``pytorch_lightning``; with both installed, a
``pytorch_lightning.Trainer`` takes :class:`bagua.lightning.for_pytorch_lightning.BaguaStrategy`.

Lightning is imported on first use of these names, so that this package (and the registration hook) stays
cheap to import and Bagua works without Lightning installed.

Example:
    >>> from lightning.pytorch import Trainer  # doctest: +SKIP
    >>> from bagua.lightning import BaguaStrategy  # doctest: +SKIP
    >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=BaguaStrategy(algorithm="decentralized"))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BaguaStrategy", "BaguaEnvironment"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from bagua.lightning import _api

        module = importlib.import_module(f"bagua.lightning.for_{_api.default_flavor()}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
