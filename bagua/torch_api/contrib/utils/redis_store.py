"""RedisStore: the dataset cache on ``redis-server``, either started for the job or given by the user.

With ``hosts=None`` the local rank 0 of every node starts one ``redis-server`` for the job, and every rank learns
every server's address through one ``all_gather`` of a fixed-size ``uint8`` tensor on the default process group
(no pickle). Each server

- listens on the node's address only: loopback when the job is single-node or ``MASTER_ADDR`` is a loopback
  address, otherwise the address of the interface that routes to ``MASTER_ADDR`` (override with ``bind=``);
- requires a fresh random password (``secrets.token_hex``), given to it on stdin rather than on the command line
  that every local user can read, with protected mode on;
- keeps data in memory only (``save ""``, ``appendonly no``), capped by ``capacity_per_node`` bytes with the
  ``maxmemory_policy`` eviction policy (``allkeys-random`` by default, like the original; ``noeviction`` makes a
  full server refuse writes, which the cache treats as a store fault);
- is terminated at interpreter exit (multiprocessing children included), and also when the process that
  started it dies without running exit handlers (Linux ``setpriv --pdeathsig``, when available).

With ``hosts=[{"host": ..., "port": ..., "password": ...}, ...]`` it only connects. ``cluster_mode=True`` spreads
keys over all servers by rendezvous hashing (:class:`~.store.ClusterStore`); ``False`` uses the one server
``hosts[node_rank % len(hosts)]``. Creating a ``RedisStore`` with ``hosts=None`` while ``torch.distributed`` is
initialized is a collective: every rank must create it, in the same order.

Example:
    >>> store = RedisStore()  # doctest: +SKIP
    >>> store.mset({"a": b"1"}); store.mget(["a"])  # doctest: +SKIP
    [b'1']
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

from bagua.torch_api import env
from bagua.torch_api.contrib.utils.redis_server import (
    _SERVER, _job_servers, _require_redis, _stop_server, find_free_port, start_redis_server, start_redis_server_cli,
)
from bagua.torch_api.contrib.utils.store import ClusterStore, Store, StoreError, StoreFullError

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only without the extra
    redis = None

# start_redis_server and the original's helper names (start_redis_server_cli, find_free_port) live in
# redis_server.py and are re-exported here, their original path
__all__ = ["RedisStore", "RedisShard", "start_redis_server", "DEFAULT_CAPACITY", "start_redis_server_cli",
           "find_free_port"]

#: Memory cap of a spawned server, in bytes (the original's 100 GiB).
DEFAULT_CAPACITY = 100 * 1024**3
_POLICIES = (
    "noeviction", "allkeys-lru", "allkeys-lfu", "allkeys-random",
    "volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl",
)


class RedisShard(Store):
    """One ``redis-server``, as a :class:`Store`. The client is made lazily in each process that uses it.

    Args:
        host, port, password: where to connect.
        socket_timeout: seconds a command may take before the server counts as down.
    """

    def __init__(self, host: str, port: int, password: Optional[str] = None, socket_timeout: float = 5.0) -> None:
        _require_redis()
        self.host, self.port, self.password = host, int(port), password
        self.socket_timeout = socket_timeout
        self._client: Optional[Any] = None
        self._pid = -1

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_client"], state["_pid"] = None, -1
        return state

    def _redis(self) -> Any:
        if self._client is None or self._pid != os.getpid():
            # One immediate retry covers a pooled connection the server dropped; a server that is really down
            # must fail fast, since the cache then serves from the dataset (redis-py's default backs off ~7 s).
            self._client = redis.Redis(
                host=self.host, port=self.port, password=self.password,
                socket_timeout=self.socket_timeout, socket_connect_timeout=min(self.socket_timeout, 2.0),
                retry=Retry(NoBackoff(), 1),
            )
            self._pid = os.getpid()
        return self._client

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._redis(), method)(*args)
        except redis.exceptions.ResponseError as error:
            # redis-py turns the server's "OOM ..." reply into OutOfMemoryError (5.x+); match the text for older ones.
            if isinstance(error, getattr(redis.exceptions, "OutOfMemoryError", ())) or "maxmemory" in str(error):
                raise StoreFullError(f"redis {self.host}:{self.port} is full: {error}") from error
            raise StoreError(f"redis {self.host}:{self.port} refused {method}: {error}") from error
        except redis.exceptions.RedisError as error:
            raise StoreError(f"redis {self.host}:{self.port} unavailable: {error}") from error

    def mset(self, mapping: Mapping[str, bytes]) -> None:
        if mapping:
            self._call("mset", dict(mapping))

    def mget(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        return list(self._call("mget", list(keys))) if keys else []

    def num_keys(self) -> int:
        return int(self._call("dbsize"))

    def clear(self) -> None:
        self._call("flushdb")

    def status(self) -> bool:
        try:
            return bool(self._call("ping"))
        except StoreError:
            return False

    def shutdown(self) -> None:
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client, self._pid = None, -1


class RedisStore(ClusterStore):
    """A :class:`~.store.ClusterStore` over ``redis-server`` instances, started for the job or given.

    Args:
        hosts: ``[{"host": str, "port": int, "password": str (optional)}, ...]`` to connect to existing servers;
            ``None`` starts one server per node (see the module docstring).
        cluster_mode: shard keys over all servers (True) or use ``hosts[node_rank % len(hosts)]`` only.
        capacity_per_node: ``maxmemory`` of a started server, in bytes.
        maxmemory_policy: eviction policy of a started server, one of redis' ``maxmemory-policy`` values.
        bind: address a started server listens on; default: the node's address as described above.
        socket_timeout: seconds a command may take before the server counts as down.

    Example:
        >>> RedisStore(hosts=[{"host": "10.0.0.5", "port": 6379, "password": "s3cret"}])  # doctest: +SKIP
    """

    def __init__(
        self,
        hosts: Optional[list[dict[str, Any]]] = None,
        cluster_mode: bool = True,
        capacity_per_node: int = DEFAULT_CAPACITY,
        maxmemory_policy: str = "allkeys-random",
        bind: Optional[str] = None,
        socket_timeout: float = 5.0,
    ) -> None:
        _require_redis()
        if capacity_per_node <= 0:
            raise ValueError(f"capacity_per_node={capacity_per_node} must be a positive number of bytes")
        if maxmemory_policy not in _POLICIES:
            raise ValueError(f"unknown maxmemory_policy {maxmemory_policy!r}; choose one of {list(_POLICIES)}")
        if socket_timeout <= 0:
            raise ValueError(f"socket_timeout={socket_timeout} must be a positive number of seconds")
        started = hosts is None
        if started:
            hosts = _job_servers(capacity_per_node, maxmemory_policy, bind)
        hosts = _checked_hosts(hosts)
        # Only a store that asked for servers may stop this process's server; a connect-only store never does.
        self._owns_server = started and _SERVER.get("pid") == os.getpid()
        if not cluster_mode:
            hosts = [hosts[env.get_node_rank() % len(hosts)]]
        self.hosts = hosts
        shards = [RedisShard(h["host"], h["port"], h.get("password"), socket_timeout) for h in hosts]
        super().__init__(shards, names=[f"{h['host']}:{h['port']}" for h in hosts])

    def shutdown(self) -> None:
        """Close connections; a store made with ``hosts=None`` also stops this process's server (for every rank)."""
        super().shutdown()
        if self._owns_server:
            _stop_server()


def _checked_hosts(hosts: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if not hosts:
        raise ValueError("hosts is empty; pass None to start a server per node, or a list of {'host', 'port'}")
    out = []
    for item in hosts:
        if not isinstance(item, Mapping) or "host" not in item or "port" not in item:
            raise ValueError(f"each host must be a dict with 'host' and 'port' (and 'password'), got {item!r}")
        out.append({"host": str(item["host"]), "port": int(item["port"]), "password": item.get("password")})
    return out
