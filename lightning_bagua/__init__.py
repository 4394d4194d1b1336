"""``lightning_bagua``: the name under which Lightning and the original plugin expose Bagua's strategy.

The original Lightning-Universe ``lightning_bagua`` package exported ``BaguaStrategy`` and ``BaguaEnvironment``;
this package re-exports :mod:`bagua.lightning`'s, so ``from lightning_bagua import BaguaStrategy`` keeps working.
Importing it also registers ``"bagua"`` in Lightning's strategy registry (an installed Bagua does that when
``torch`` is imported; see :mod:`bagua.lightning.registration`).

Example:
    >>> from lightning_bagua import BaguaStrategy  # doctest: +SKIP
    >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=BaguaStrategy(algorithm="bytegrad"))  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from bagua.lightning import registration as _registration

__all__ = ["BaguaStrategy", "BaguaEnvironment"]

_registration.install()


def __getattr__(name: str) -> Any:
    if name in __all__:
        import bagua.lightning

        return getattr(bagua.lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
