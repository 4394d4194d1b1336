"""Build ``BaguaEnvironment`` and ``BaguaStrategy`` on one flavor of Lightning (see :mod:`bagua.lightning._api`).

The two flavors need the same two classes over different Lightning base classes; :mod:`.for_lightning` and
:mod:`.for_pytorch_lightning` each build theirs here, named as classes of their own module (so that pickling,
``repr`` and Lightning's registry see ``bagua.lightning.for_lightning.BaguaStrategy``, say).

Example:
    >>> BaguaEnvironment, BaguaStrategy = build("lightning", "bagua.lightning.for_lightning")  # doctest: +SKIP
"""

from __future__ import annotations

from bagua.lightning import _api
from bagua.lightning.environment import BaguaEnvironmentBase
from bagua.lightning.strategy import BaguaStrategyBase

__all__ = ["build"]


def build(flavor: str, module: str) -> tuple[type, type]:
    """Return ``(BaguaEnvironment, BaguaStrategy)`` for ``flavor``'s Trainer, as classes of ``module``."""
    lightning = _api.load(flavor)

    class BaguaEnvironment(BaguaEnvironmentBase, lightning.ClusterEnvironment):
        __doc__ = BaguaEnvironmentBase.__doc__

    class BaguaStrategy(BaguaStrategyBase, lightning.DDPStrategy):
        __doc__ = BaguaStrategyBase.__doc__
        _api = lightning
        _environment_cls = BaguaEnvironment

    for cls in (BaguaEnvironment, BaguaStrategy):
        cls.__module__, cls.__qualname__ = module, cls.__name__
    return BaguaEnvironment, BaguaStrategy
