"""Fixtures shared by the fault-tolerance tests."""

from __future__ import annotations

import pytest

from bagua.torch_api.fault.coordinator import start_coordinator
from tests.fault.test_quorum import _free_port


@pytest.fixture()
def coordinator():
    """A coordinator process on a free loopback port, killed after the test: its ``host:port``."""
    port = _free_port()
    proc = start_coordinator("127.0.0.1", port)
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()
