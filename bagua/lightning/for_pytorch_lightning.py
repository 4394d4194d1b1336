"""``BaguaStrategy`` and ``BaguaEnvironment`` for ``pytorch_lightning.Trainer`` (with ``lightning_fabric``).

Example:
    >>> from bagua.lightning.for_pytorch_lightning import BaguaStrategy  # doctest: +SKIP
"""

from __future__ import annotations

from bagua.lightning._classes import build

__all__ = ["BaguaStrategy", "BaguaEnvironment"]

BaguaEnvironment, BaguaStrategy = build("pytorch_lightning", __name__)
