"""Fixtures shared by the fault-tolerance tests."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

from bagua.torch_api.fault.coordinator import start_coordinator
from tests.fault.jobs import free_port


@contextlib.contextmanager
def running_coordinator() -> Iterator[str]:
    """A coordinator process on a free loopback port, killed on exit: its ``host:port``."""
    port = free_port()
    proc = start_coordinator("127.0.0.1", port)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture()
def coordinator():
    """A coordinator for one test (:func:`running_coordinator`)."""
    with running_coordinator() as address:
        yield address
