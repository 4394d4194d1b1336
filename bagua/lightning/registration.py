"""Make ``Trainer(strategy="bagua")`` work without the user's script importing Bagua.

Lightning 2.0-2.2 imported ``lightning_bagua`` itself when a distribution named ``lightning-bagua`` was
installed; Lightning 2.3 and later (PR #19445) have no such lookup: a strategy name is valid only if it is in
``StrategyRegistry`` when the ``Trainer`` is built, and no Lightning entry point is read before that.

So Bagua runs :func:`autoload` whenever ``torch`` is imported (which Lightning always does first), through
torch's extension autoloading: the installed distribution declares the entry point
``[project.entry-points."torch.backends"] bagua_lightning = "bagua.lightning.registration:autoload"`` (torch >= 2.5
calls every ``torch.backends`` entry point at the end of ``import torch``; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
turns that off). :func:`autoload` costs the import of this module only: it watches for the import of
``lightning.pytorch.strategies`` and ``pytorch_lightning.strategies`` and, right after either module has run,
registers ``"bagua"`` in its ``StrategyRegistry`` through Lightning's public ``register``. What it registers is a
small factory, so Bagua's strategy module (and Lightning) are imported only when a Trainer asks for ``"bagua"``.

``import lightning_bagua`` calls :func:`install` too (older torch, autoloading turned off, or a source checkout
that is not installed).

Example:
    >>> from bagua.lightning import registration
    >>> registration.install()
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

__all__ = ["autoload", "install", "register", "LazyBaguaStrategy"]

#: The modules that define a ``StrategyRegistry``, and the flavor (see ``bagua.lightning._api``) of each.
STRATEGY_MODULES: dict[str, str] = {
    "lightning.pytorch.strategies": "lightning",
    "pytorch_lightning.strategies": "pytorch_lightning",
}
_DESCRIPTION = "Bagua: communication-efficient data-parallel training (bagua.lightning.BaguaStrategy)"
_lock = threading.Lock()


class LazyBaguaStrategy:
    """A registry entry that imports and builds ``BaguaStrategy`` of one flavor when a Trainer asks for it.

    Args:
        flavor: ``"lightning"`` or ``"pytorch_lightning"``.
    """

    def __init__(self, flavor: str) -> None:
        self.flavor = flavor

    def __call__(self, **init_params: Any) -> Any:
        module = importlib.import_module(f"bagua.lightning.for_{self.flavor}")
        return module.BaguaStrategy(**init_params)

    def __repr__(self) -> str:
        return f"LazyBaguaStrategy({self.flavor!r})"


def register(strategies_module: ModuleType, flavor: str) -> None:
    """Register ``"bagua"`` in ``strategies_module.StrategyRegistry`` unless a strategy has that name already."""
    registry = getattr(strategies_module, "StrategyRegistry", None)
    if registry is not None and "bagua" not in registry:
        registry.register("bagua", LazyBaguaStrategy(flavor), description=_DESCRIPTION)


class _RegisterAfterExec(importlib.abc.Loader):
    """Runs the real loader, then ``on_loaded(module)``; everything else is the real loader's."""

    def __init__(self, loader: importlib.abc.Loader, on_loaded: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._on_loaded = on_loaded

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back first, so that reload() and resource readers never see this wrapper.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._on_loaded(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _StrategyModuleWatcher(importlib.abc.MetaPathFinder):
    """A meta-path finder that only answers for :data:`STRATEGY_MODULES`, by asking the finders after it."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        flavor = STRATEGY_MODULES.get(fullname)
        if flavor is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisterAfterExec(spec.loader, lambda module: register(module, flavor))
        return spec


def install() -> None:
    """Register ``"bagua"`` now in the strategy modules already imported, and later in the others (idempotent)."""
    with _lock:
        if not any(isinstance(f, _StrategyModuleWatcher) for f in sys.meta_path):
            sys.meta_path.insert(0, _StrategyModuleWatcher())
    for name, flavor in STRATEGY_MODULES.items():
        module = sys.modules.get(name)
        if module is not None:
            register(module, flavor)


def autoload() -> None:
    """The ``torch.backends`` entry point: :func:`install`, warning instead of raising (an exception here would
    make ``import torch`` itself fail)."""
    try:
        install()
    except Exception as exc:  # noqa: BLE001 - see the docstring
        warnings.warn(f"Bagua could not register Trainer(strategy='bagua'): {exc!r}; import lightning_bagua instead")
