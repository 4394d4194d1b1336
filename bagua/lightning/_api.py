"""The Lightning symbols Bagua's strategy needs, from either distribution of Lightning 2.x.

Lightning ships the same code twice: the ``lightning`` package (``lightning.pytorch`` + ``lightning.fabric``) and
the ``pytorch_lightning`` + ``lightning_fabric`` pair. Their classes are distinct, so a strategy for a
``lightning.pytorch.Trainer`` must subclass ``lightning.pytorch``'s ``DDPStrategy`` and one for a
``pytorch_lightning.Trainer`` the other; each *flavor* below names one of the two.

Example:
    >>> from bagua.lightning import _api
    >>> _api.default_flavor() in _api.FLAVORS  # doctest: +SKIP
    True
"""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace

__all__ = ["FLAVORS", "available_flavors", "default_flavor", "load"]

#: flavor -> (the Trainer's package, its Fabric package)
FLAVORS: dict[str, tuple[str, str]] = {
    "lightning": ("lightning.pytorch", "lightning.fabric"),
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
}

_INSTALL_HINT = "Bagua's Lightning strategy needs Lightning 2.x: `pip install lightning` (or `pip install bagua[lightning]`)"


def available_flavors() -> list[str]:
    """The flavors whose packages are installed, ``"lightning"`` first."""
    return [name for name, (trainer_pkg, _) in FLAVORS.items() if importlib.util.find_spec(trainer_pkg.split(".")[0])]


def default_flavor() -> str:
    """``"lightning"`` when installed, else ``"pytorch_lightning"``; ``ImportError`` saying what to install otherwise."""
    flavors = available_flavors()
    if not flavors:
        raise ImportError(_INSTALL_HINT)
    return flavors[0]


def load(flavor: str) -> SimpleNamespace:
    """Import the Lightning classes and helpers the strategy uses, from ``flavor``'s packages.

    Args:
        flavor: ``"lightning"`` or ``"pytorch_lightning"``.

    Returns:
        A namespace with ``DDPStrategy``, ``ClusterEnvironment``, ``LightningOptimizer``,
        ``MisconfigurationException``, ``reset_seed``, ``optimizers_to_device`` and ``StrategyRegistry``.
    """
    if flavor not in FLAVORS:
        raise ValueError(f"unknown Lightning flavor {flavor!r}; choose one of {sorted(FLAVORS)}")
    trainer_pkg, fabric_pkg = FLAVORS[flavor]
    try:
        strategies = importlib.import_module(f"{trainer_pkg}.strategies")
        optimizer = importlib.import_module(f"{trainer_pkg}.core.optimizer")
        environments = importlib.import_module(f"{fabric_pkg}.plugins.environments")
        exceptions = importlib.import_module(f"{fabric_pkg}.utilities.exceptions")
        seed = importlib.import_module(f"{fabric_pkg}.utilities.seed")
        fabric_optimizer = importlib.import_module(f"{fabric_pkg}.utilities.optimizer")
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc
    return SimpleNamespace(
        flavor=flavor,
        DDPStrategy=strategies.DDPStrategy,
        StrategyRegistry=strategies.StrategyRegistry,
        ClusterEnvironment=environments.ClusterEnvironment,
        LightningOptimizer=optimizer.LightningOptimizer,
        MisconfigurationException=exceptions.MisconfigurationException,
        reset_seed=seed.reset_seed,
        # Lightning's own helper (private, but DDPStrategy.setup uses it the same way): keeps "step" where it is.
        optimizers_to_device=fabric_optimizer._optimizers_to_device,
    )
