"""Fixtures for the data-pipeline tests: a real redis-server started independently of the code under test."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import time

import pytest

from bagua.torch_api import env


def start_redis(maxmemory: int = 64 * 1024**2, policy: str = "allkeys-random") -> tuple[subprocess.Popen, dict]:
    """Start redis-server on 127.0.0.1 with a password; return the process and its ``{"host", "port", "password"}``."""
    import redis

    port = env.find_free_network_port()
    password = secrets.token_hex(8)
    process = subprocess.Popen(
        [shutil.which("redis-server"), "--bind", "127.0.0.1", "--port", str(port), "--requirepass", password,
         "--save", "", "--appendonly", "no", "--maxmemory", str(maxmemory), "--maxmemory-policy", policy],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
    client.close()
    return process, {"host": "127.0.0.1", "port": port, "password": password}


@pytest.fixture
def redis_servers():
    """Factory: ``redis_servers(n, **kw)`` starts n servers, all stopped after the test; returns (processes, hosts)."""
    started: list[subprocess.Popen] = []

    def make(count: int = 1, **kwargs):
        pairs = [start_redis(**kwargs) for _ in range(count)]
        started.extend(p for p, _ in pairs)
        return [p for p, _ in pairs], [h for _, h in pairs]

    yield make
    for process in started:
        process.kill()
        process.wait(timeout=10)
