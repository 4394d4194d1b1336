"""The ``bagua`` logger: level from BAGUA_LOG_LEVEL, rank-prefixed records on stderr, root logger untouched."""

from __future__ import annotations

import io
import logging

import pytest

from bagua.torch_api import _log, env


@pytest.fixture
def fresh_bagua_logger():
    """The ``bagua`` logger without Bagua's handler, restored afterwards."""
    logger = logging.getLogger("bagua")
    saved = logger.handlers[:], logger.level, logger.propagate
    logger.handlers = [h for h in logger.handlers if h.get_name() != "bagua-stderr"]
    yield logger
    logger.handlers, logger.level, logger.propagate = list(saved[0]), saved[1], saved[2]


def test_log_level_from_the_environment(monkeypatch):
    monkeypatch.delenv("BAGUA_LOG_LEVEL", raising=False)
    assert env.get_log_level() == "INFO"
    monkeypatch.setenv("BAGUA_LOG_LEVEL", "debug")
    assert env.get_log_level() == "DEBUG"
    monkeypatch.setenv("BAGUA_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="BAGUA_LOG_LEVEL='LOUD'.*DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        env.get_log_level()


def test_configure_once_with_rank_prefix(monkeypatch, fresh_bagua_logger):
    root_handlers = logging.getLogger().handlers[:]
    monkeypatch.setenv("BAGUA_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("RANK", "3")
    logger = _log.configure()
    assert _log.configure() is logger and [h.get_name() for h in logger.handlers].count("bagua-stderr") == 1
    assert logger.level == logging.WARNING and not logger.propagate
    assert logging.getLogger().handlers == root_handlers
    handler = next(h for h in logger.handlers if h.get_name() == "bagua-stderr")
    stream = io.StringIO()
    handler.setStream(stream)
    logging.getLogger("bagua.autotune.controller").info("hidden below WARNING")
    logging.getLogger("bagua.autotune.controller").warning("trial %d done", 2)
    logging.getLogger("elsewhere").warning("not Bagua's")
    assert stream.getvalue() == "[bagua rank 3] WARNING bagua.autotune.controller: trial 2 done\n"
