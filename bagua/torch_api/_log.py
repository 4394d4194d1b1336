"""Bagua's log: the ``bagua`` logger and its children, rank-prefixed, at the level ``BAGUA_LOG_LEVEL`` sets.

Every Bagua module logs through ``logging.getLogger(__name__)``; :func:`configure` (run once, when ``bagua`` is
imported) gives the ``bagua`` logger its level and one stderr handler that prefixes each record with the rank of
the process that wrote it::

    [bagua rank 0] INFO bagua.autotune.controller: autotune: trial 3/20: bucket 4 MiB, ...: 812.4 samples/s

The root logger is left alone, and Bagua's records do not propagate to it (they would be printed twice
under ``logging.basicConfig``). To route them to your own handlers instead, remove the handler and turn
propagation back on: ``logging.getLogger("bagua").handlers.clear(); logging.getLogger("bagua").propagate = True``.

Example:
    >>> from bagua.torch_api import _log
    >>> _log.configure() is _log.configure()
    True
"""

from __future__ import annotations

import logging
import sys

from bagua.torch_api import env

__all__ = ["configure", "RankFilter", "FORMAT"]

FORMAT = "[bagua rank %(bagua_rank)s] %(levelname)s %(name)s: %(message)s"
_HANDLER_NAME = "bagua-stderr"


class RankFilter(logging.Filter):
    """Set ``record.bagua_rank``: the process's rank in ``torch.distributed`` once it is initialized, else the
    launcher's ``RANK`` (so records written before ``init_process_group`` carry the right rank too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.bagua_rank = _rank()
        return True


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env.get_rank()


def configure() -> logging.Logger:
    """Set up the ``bagua`` logger once (later calls return it unchanged); return it.

    Raises:
        ValueError: ``BAGUA_LOG_LEVEL`` is not a level name (the message lists them).
    """
    logger = logging.getLogger("bagua")
    if any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        return logger
    logger.setLevel(env.get_log_level())
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(RankFilter())
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.propagate = False
    return logger
