"""Stores: LMDB across processes and when full, rendezvous sharding, and real redis-servers (spawned or given)."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import socket

import pytest
import torch.distributed as dist

from bagua.torch_api.contrib.utils.lmdb_store import LmdbStore
from bagua.torch_api.contrib.utils.store import ClusterStore, Store, StoreError, StoreFullError, rendezvous_owner
from tests.harness import run_workers


class DictStore(Store):
    """The in-process reference store."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def mset(self, mapping):
        self.data.update(mapping)

    def mget(self, keys):
        return [self.data.get(k) for k in keys]

    def num_keys(self):
        return len(self.data)

    def clear(self):
        self.data.clear()


def _exercise(store: Store) -> None:
    """The Store contract, checked against a dict."""
    reference = {f"k{i}": bytes([i % 256]) * (i * 37 % 1000) for i in range(300)}
    store.clear()
    store.set("single", b"value")
    store.mset(reference)
    assert store.get("single") == b"value" and store.get("absent") is None
    keys = ["absent", *reversed(list(reference)), "single"]
    assert store.mget(keys) == [None, *reversed(list(reference.values())), b"value"]
    store.mset({"k1": b"overwritten"})
    assert store.get("k1") == b"overwritten"
    assert store.num_keys() == len(reference) + 1 and store.status()
    store.clear()
    assert store.num_keys() == 0 and store.get("k2") is None


# ------------------------------------------------------------------------------------------------------- LMDB


def test_lmdb_store_contract(tmp_path):
    _exercise(LmdbStore(str(tmp_path / "db"), map_size=64 << 20))


def _lmdb_writer(path: str, first: int, count: int) -> None:
    store = LmdbStore(path, map_size=64 << 20)
    for start in range(first, first + count, 10):
        store.mset({f"k{i}": str(i).encode() * 50 for i in range(start, start + 10)})
    assert store.get(f"k{first}") == str(first).encode() * 50


def test_lmdb_is_shared_by_forked_and_spawned_processes(tmp_path):
    path = str(tmp_path / "db")
    parent = LmdbStore(path, map_size=64 << 20)
    parent.mset({"parent": b"p"})  # the parent holds an open handle when it forks
    procs = [mp.get_context(method).Process(target=_lmdb_writer, args=(path, 1000 * r, 200))
             for r, method in enumerate(["fork", "fork", "spawn"])]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    expected = {f"k{i}": str(i).encode() * 50 for r in range(3) for i in range(1000 * r, 1000 * r + 200)}
    assert parent.mget(list(expected)) == list(expected.values())
    assert parent.num_keys() == 601 and parent.get("parent") == b"p"
    # a second store on the same path in this process shares the handle and sees the same data
    assert LmdbStore(path).num_keys() == 601


def test_lmdb_full_map_raises_store_full_and_keeps_serving(tmp_path):
    store = LmdbStore(str(tmp_path / "db"), map_size=256 * 1024)
    store.mset({"small": b"x" * 1000})
    with pytest.raises(StoreFullError, match="map_size"):
        store.mset({"big1": b"y" * 200_000, "big2": b"z" * 200_000})
    assert store.mget(["small", "big1", "big2"]) == [b"x" * 1000, None, None]  # the failed batch wrote nothing
    assert store.num_keys() == 1


def test_lmdb_validation(tmp_path):
    with pytest.raises(ValueError, match="map_size"):
        LmdbStore(str(tmp_path), map_size=0)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="db"):  # at construction, not at the first read
        LmdbStore(str(blocker / "db"))


# ------------------------------------------------------------------------------------------------- sharding


def test_cluster_store_contract_matches_dict():
    shards = [DictStore() for _ in range(3)]
    cluster = ClusterStore(shards, names=["a", "b", "c"])
    _exercise(cluster)
    cluster.mset({f"x{i}": b"v" for i in range(3000)})
    sizes = [s.num_keys() for s in shards]
    assert sum(sizes) == 3000 and min(sizes) > 850  # about a third each
    for index, shard in enumerate(shards):
        assert all(cluster.owner(k) == index for k in shard.data)


def test_rendezvous_hashing_moves_only_keys_to_the_new_store():
    keys = [f"dataset_{i}" for i in range(20_000)]
    before = [rendezvous_owner(k, ["n0", "n1", "n2", "n3"]) for k in keys]
    after = [rendezvous_owner(k, ["n0", "n1", "n2", "n3", "n4"]) for k in keys]
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert all(a == 4 for _, a in moved)  # nothing moves between old stores
    assert 0.17 < len(moved) / len(keys) < 0.23  # about 1/5, against 4/5 for hash % n
    modulo_moved = sum(hash(k) % 4 != hash(k) % 5 for k in keys) / len(keys)
    assert modulo_moved > 0.7
    # order of the names does not matter, only the names themselves
    assert [rendezvous_owner(k, ["n3", "n2", "n1", "n0"]) for k in keys[:200]] == [3 - b for b in before[:200]]


def test_cluster_store_validation():
    with pytest.raises(ValueError, match="at least one"):
        ClusterStore([])
    with pytest.raises(ValueError, match="distinct"):
        ClusterStore([DictStore(), DictStore()], names=["a", "a"])
    with pytest.raises(ValueError, match="one name per store"):
        ClusterStore([DictStore()], names=["a", "b"])


# ---------------------------------------------------------------------------------------------------- redis


@pytest.mark.redis
def test_redis_store_given_hosts(redis_servers):
    from bagua.torch_api.contrib.utils.redis_store import RedisStore

    _, hosts = redis_servers(1)
    _exercise(RedisStore(hosts=hosts))


@pytest.mark.redis
def test_redis_cluster_of_three_spreads_keys(redis_servers):
    from bagua.torch_api.contrib.utils.redis_store import RedisStore

    _, hosts = redis_servers(3)
    store = RedisStore(hosts=hosts)
    _exercise(store)
    store.mset({f"x{i}": b"v" for i in range(900)})
    sizes = [shard.num_keys() for shard in store.stores]
    assert sum(sizes) == 900 and min(sizes) > 200
    single = RedisStore(hosts=hosts, cluster_mode=False)  # node_rank 0 -> hosts[0] only
    assert single.num_keys() == sizes[0]


@pytest.mark.redis
def test_redis_store_down_and_full_raise_store_errors(redis_servers):
    from bagua.torch_api.contrib.utils.redis_store import RedisStore

    (process,), hosts = redis_servers(1, maxmemory=2 * 1024**2, policy="noeviction")
    store = RedisStore(hosts=hosts, socket_timeout=2)
    with pytest.raises(StoreFullError):
        for i in range(20):
            store.mset({f"big{i}": b"x" * 500_000})
    assert store.get("big0") == b"x" * 500_000
    process.kill()
    process.wait()
    with pytest.raises(StoreError):
        store.mget(["big0"])
    assert not store.status()


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0


@pytest.mark.redis
def test_spawned_redis_server_is_private_and_stopped():
    import redis

    from bagua.torch_api.contrib.utils import redis_server, redis_store

    store = redis_store.RedisStore(capacity_per_node=32 * 1024**2, maxmemory_policy="allkeys-lru")
    (host,) = store.hosts
    try:
        assert host["host"] == "127.0.0.1" and len(host["password"]) == 32
        with pytest.raises(redis.exceptions.AuthenticationError):
            # no retries: redis-py's default retries an AuthenticationError for seconds
            redis.Redis(host=host["host"], port=host["port"],
                        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0)).get("k")
        admin = redis.Redis(host=host["host"], port=host["port"], password=host["password"], decode_responses=True)
        config = {k: admin.config_get(k)[k] for k in
                  ("bind", "protected-mode", "maxmemory", "maxmemory-policy", "save", "appendonly")}
        assert config == {"bind": "127.0.0.1", "protected-mode": "yes", "maxmemory": str(32 * 1024**2),
                          "maxmemory-policy": "allkeys-lru", "save": "", "appendonly": "no"}
        pid = redis_server._SERVER["process"].pid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert host["password"].encode() not in f.read()  # not visible to other local users
        _exercise(store)
    finally:
        store.shutdown()
    assert not _port_open(host["host"], host["port"])


def _worker_spawned_servers(rank, world_size, store_path):
    from bagua.torch_api.contrib.utils.redis_store import RedisStore

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    store = RedisStore(capacity_per_node=32 * 1024**2)
    store.mset({f"r{rank}_{i}": f"{rank}:{i}".encode() for i in range(200)})
    dist.barrier()
    other = 1 - rank
    seen = store.mget([f"r{other}_{i}" for i in range(200)])
    assert seen == [f"{other}:{i}".encode() for i in range(200)]
    shard_sizes = [shard.num_keys() for shard in store.stores]
    dist.barrier()
    return store.hosts, shard_sizes


@pytest.mark.redis
@pytest.mark.parametrize("local_size", [2, 1], ids=["one-node", "two-nodes"])
def test_spawned_servers_are_shared_through_the_process_group(tmp_path, local_size):
    results = run_workers(_worker_spawned_servers, 2, str(tmp_path / "store"), local_size=local_size,
                          init_bagua=False, timeout=60)
    hosts = results[0][0]
    assert results[1][0] == hosts and len(hosts) == 2 // local_size
    assert all(h["host"] == "127.0.0.1" for h in hosts)
    assert sum(results[0][1]) == 400 and min(results[0][1]) > 0  # both servers used when there are two
    for h in hosts:  # every server stopped when the rank that started it exited
        assert not _port_open(h["host"], h["port"])


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv for --pdeathsig")
def test_spawned_server_dies_with_a_killed_owner():
    import subprocess
    import sys
    import time

    script = ("import os, signal\n"
              "from bagua.torch_api.contrib.utils.redis_store import RedisStore\n"
              "store = RedisStore(capacity_per_node=32 * 1024**2)\n"
              "print(store.hosts[0]['port'], flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no finalizers\n")
    owner = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert owner.returncode == -9, owner.stderr
    port = int(owner.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _port_open("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _port_open("127.0.0.1", port)
