"""The coordinator process stops cleanly: SIGTERM or Ctrl-C (SIGINT) end it with status 0 and nothing on stderr.

It used to print a traceback at every clean stop (``OSError: [Errno 9] Bad file descriptor`` from ``serve()``: the
store had closed the listening socket it was handed, then ``sock.close()`` closed it again).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_coordinator_without_a_traceback(sig):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "bagua.torch_api.fault.coordinator", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "listening on 127.0.0.1" in proc.stdout.readline()
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # it serves
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and err == "", err
