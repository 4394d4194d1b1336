"""``BaguaStrategy`` and ``BaguaEnvironment`` for ``lightning.pytorch.Trainer`` (the ``lightning`` package).

Example:
    >>> from bagua.lightning.for_lightning import BaguaStrategy  # doctest: +SKIP
"""

from __future__ import annotations

from bagua.lightning._classes import build

__all__ = ["BaguaStrategy", "BaguaEnvironment"]

BaguaEnvironment, BaguaStrategy = build("lightning", __name__)
