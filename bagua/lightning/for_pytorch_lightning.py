"""``BaguaStrategy`` and ``BaguaEnvironment`` for ``pytorch_lightning.Trainer`` (``pytorch_lightning`` + ``lightning_fabric``).

Example:
    >>> from bagua.lightning.for_pytorch_lightning import BaguaStrategy  # doctest: +SKIP
"""

from __future__ import annotations

from bagua.lightning import _api
from bagua.lightning.environment import BaguaEnvironmentBase
from bagua.lightning.strategy import BaguaStrategyBase

__all__ = ["BaguaStrategy", "BaguaEnvironment"]

_lightning = _api.load("pytorch_lightning")


class BaguaEnvironment(BaguaEnvironmentBase, _lightning.ClusterEnvironment):
    __doc__ = BaguaEnvironmentBase.__doc__


class BaguaStrategy(BaguaStrategyBase, _lightning.DDPStrategy):
    __doc__ = BaguaStrategyBase.__doc__
    _api = _lightning
    _environment_cls = BaguaEnvironment
