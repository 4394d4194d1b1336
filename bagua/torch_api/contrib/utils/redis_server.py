"""Starting ``redis-server``: the job's private server behind :class:`~.redis_store.RedisStore`, and the original's
detached one.

- :func:`start_redis_server` starts this process's server (at most one; it is stopped at exit) with the settings
  listed in the :mod:`~bagua.torch_api.contrib.utils.redis_store` docstring; :func:`_job_servers` starts one per
  node (local rank 0) and all-gathers every server's address.
- :func:`start_redis_server_cli` and :func:`find_free_port` are the original's helper names: a server that
  outlives its caller, on loopback with a password.

Part of :mod:`bagua.torch_api.contrib.utils.redis_store`, which re-exports these public names.
"""

from __future__ import annotations

import multiprocessing.util
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from bagua.torch_api import env

try:
    import redis
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None

__all__ = ["start_redis_server", "start_redis_server_cli", "find_free_port"]

_INFO_BYTES = 256  # one rank's "host port password" in the all_gather

# The server this process started (at most one; later RedisStores reuse it) and the pid that may stop it.
_SERVER: dict[str, Any] = {}
_SERVER_LOCK = threading.Lock()


def _require_redis() -> None:
    if redis is None:
        raise ImportError("backend='redis' needs the 'redis' package: pip install redis")


def start_redis_server(bind: str, capacity: int, policy: str, startup_timeout: float = 15.0) -> dict[str, Any]:
    """Start ``redis-server`` on ``bind`` with a random password; return ``{"host", "port", "password"}``.

    The server is this process's (its settings are listed in the :mod:`~.redis_store` docstring) and is stopped at
    exit. A second call in the same process returns the running server.

    Args:
        bind: listening address.
        capacity: ``maxmemory`` in bytes.
        policy: ``maxmemory-policy``.
        startup_timeout: seconds to wait for the first PING.

    Returns:
        The connection details.

    Example:
        >>> start_redis_server("127.0.0.1", 1 << 30, "allkeys-random")["host"]  # doctest: +SKIP
        '127.0.0.1'
    """
    _require_redis()
    with _SERVER_LOCK:
        if _SERVER and _SERVER["process"].poll() is None and _SERVER["pid"] == os.getpid():
            if (_SERVER["capacity"], _SERVER["policy"]) != (capacity, policy):
                warnings.warn(
                    f"this process already runs a redis-server (maxmemory={_SERVER['capacity']}, policy="
                    f"{_SERVER['policy']}); reusing it, the new capacity/policy are ignored",
                    stacklevel=3,
                )
            return {k: _SERVER[k] for k in ("host", "port", "password")}
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError(
                "backend='redis' with hosts=None starts redis-server, which is not on PATH; install it "
                "(apt-get install redis-server) or pass hosts=[{'host': ..., 'port': ..., 'password': ...}]"
            )
        last_error = ""
        for _ in range(3):  # the free port may be taken between probing and binding
            port = env.find_free_network_port(bind)
            password = secrets.token_hex(16)
            process, log = _launch(executable, bind, port, password, capacity, policy)
            client = redis.Redis(host=bind, port=port, password=password, socket_connect_timeout=1.0)
            deadline = time.monotonic() + startup_timeout
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    client.ping()
                    break
                except redis.exceptions.RedisError:
                    time.sleep(0.05)
            else:
                client.close()
                process.kill()
                process.wait()
                log.seek(0)
                last_error = log.read().decode(errors="replace")[-2000:]
                continue
            client.close()
            _SERVER.clear()  # a parent's entry, inherited through fork, is not ours to keep
            _SERVER.update(process=process, log=log, pid=os.getpid(), host=bind, port=port, password=password,
                           capacity=capacity, policy=policy)
            # A multiprocessing Finalize runs at exit of the main process *and* of multiprocessing children
            # (which skip atexit), after the cache's own flush (exitpriority 10) has written pending values.
            multiprocessing.util.Finalize(None, _stop_server, exitpriority=0)
            return {"host": bind, "port": port, "password": password}
        raise RuntimeError(f"redis-server did not start on {bind}; its log ends with:\n{last_error}")


def _launch(executable: str, bind: str, port: int, password: str, capacity: int, policy: str):
    config = "\n".join([
        f"bind {bind}",
        f"port {port}",
        f"requirepass {password}",
        "protected-mode yes",
        'save ""',
        "appendonly no",
        f"maxmemory {capacity}",
        f"maxmemory-policy {policy}",
        "daemonize no",
        "loglevel warning",
        'logfile ""',
    ]) + "\n"
    command = [executable, "-"]  # "-" reads the configuration (and so the password) from stdin
    setpriv = shutil.which("setpriv")
    if setpriv and threading.current_thread() is threading.main_thread():
        # Killed with us even on SIGKILL; pdeathsig follows the creating *thread*, hence the main-thread check.
        command = [setpriv, "--pdeathsig", "TERM", "--", *command]
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, close_fds=True)
    process.stdin.write(config.encode())
    process.stdin.close()
    return process, log


def _stop_server() -> None:
    with _SERVER_LOCK:
        if not _SERVER or _SERVER["pid"] != os.getpid():  # a forked child never stops its parent's server
            return
        process = _SERVER["process"]
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        _SERVER["log"].close()
        _SERVER.clear()


def _job_servers(capacity: int, policy: str, bind: Optional[str]) -> list[dict[str, Any]]:
    """Start this node's server on local rank 0 and return every node's server, in rank order."""
    if not (dist.is_available() and dist.is_initialized()):
        return [start_redis_server(bind or "127.0.0.1", capacity, policy)]
    mine = ""
    if env.get_local_rank() == 0:
        info = start_redis_server(bind or env.node_address(), capacity, policy)
        mine = f"{info['host']} {info['port']} {info['password']}"
    found = _all_gather_strings(mine)
    hosts = []
    for text in found:
        host, port, password = text.split(" ")
        hosts.append({"host": host, "port": int(port), "password": password})
    if not hosts:
        raise RuntimeError("no rank has LOCAL_RANK=0, so no redis-server was started; check LOCAL_RANK")
    return hosts


def _all_gather_strings(text: str) -> list[str]:
    """All-gather one short ASCII string per rank as fixed-size uint8 tensors; return the non-empty ones."""
    raw = text.encode("ascii")
    if len(raw) > _INFO_BYTES:
        raise ValueError(f"server address {text!r} is longer than {_INFO_BYTES} bytes")
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.zeros(_INFO_BYTES, dtype=torch.uint8)
    if raw:
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    gathered = [torch.empty(_INFO_BYTES, dtype=torch.uint8, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine.to(device))
    out = []
    for tensor in gathered:
        value = bytes(tensor.cpu().numpy()).rstrip(b"\0").decode("ascii")
        if value:
            out.append(value)
    return out


# ----------------------------------------------------------------------------- the original's helper names

# Settings start_redis_server_cli decides itself; extra arguments may not change them.
_CLI_FIXED = ("bind", "port", "requirepass", "protected-mode", "daemonize", "unixsocket", "include", "rename-command")


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` (default loopback) a moment ago.

    Example:
        >>> 0 < find_free_port() < 65536
        True
    """
    return env.find_free_network_port(host)


def start_redis_server_cli(
    port: int, capacity: int, *args: str, bind: str = "127.0.0.1", password: Optional[str] = None,
    startup_timeout: float = 15.0,
) -> dict[str, Any]:
    """Start a detached ``redis-server`` on ``bind:port`` that outlives the caller; return how to reach it.

    As the original's function of that name, the server is not this process's: it keeps running after the caller
    exits, until someone sends it ``SHUTDOWN``. Unlike the original, it listens on ``bind`` only (loopback by
    default), requires a password (a fresh random one unless ``password`` is given), keeps protected mode on, and
    gets its configuration on stdin, so the password never appears on a command line.

    Args:
        port: listening port (see :func:`find_free_port`).
        capacity: ``maxmemory`` in bytes; keys are evicted at random beyond it (``allkeys-random``).
        *args: more configuration directives, as ``"--name value"`` or ``"name value"`` (for example
            ``"--maxmemory-policy noeviction"``); those that would change the address, port, password, protected
            mode or daemonizing are refused.
        bind: listening address.
        password: the password to require; ``None`` draws a random one.
        startup_timeout: seconds to wait for the server to answer PING.

    Returns:
        ``{"host": bind, "port": port, "password": password}``, what :class:`RedisStore` takes in ``hosts``.

    Example:
        >>> info = start_redis_server_cli(find_free_port(), 1 << 26)  # doctest: +SKIP
        >>> redis.Redis(**info).shutdown(nosave=True)  # doctest: +SKIP
    """
    _require_redis()
    executable = shutil.which("redis-server")
    if executable is None:
        raise RuntimeError("redis-server is not on PATH; install it (apt-get install redis-server)")
    extra = []
    for arg in args:
        line = str(arg).strip()
        line = line[2:] if line.startswith("--") else line
        name = line.split(None, 1)[0].lower() if line else ""
        if not name or "\n" in line:
            raise ValueError(f"bad redis-server directive {arg!r}; pass each as '--name value'")
        if name in _CLI_FIXED:
            raise ValueError(f"start_redis_server_cli sets {name!r} itself; use its bind=/password= arguments")
        extra.append(line)
    password = password or secrets.token_hex(16)
    config = "\n".join([
        f"bind {bind}", f"port {int(port)}", f"requirepass {password}", "protected-mode yes", 'save ""',
        "appendonly no", f"maxmemory {int(capacity)}", "maxmemory-policy allkeys-random", "daemonize no",
        "loglevel warning", 'logfile ""', *extra,
    ]) + "\n"
    # A new session and no pdeathsig: the server is meant to outlive this process, as a daemonized one would.
    log = tempfile.TemporaryFile()
    process = subprocess.Popen([executable, "-"], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                               close_fds=True, start_new_session=True)
    process.stdin.write(config.encode())
    process.stdin.close()
    client = redis.Redis(host=bind, port=int(port), password=password, socket_connect_timeout=1.0)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                log.seek(0)
                error = log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with code {process.returncode}: {error}")
            try:
                client.ping()
                break
            except redis.exceptions.RedisError:
                if time.monotonic() > deadline:
                    process.kill()
                    process.wait()
                    raise RuntimeError(f"redis-server did not answer on {bind}:{port} within {startup_timeout} s")
                time.sleep(0.05)
    finally:
        client.close()
        log.close()
    return {"host": bind, "port": int(port), "password": password}
