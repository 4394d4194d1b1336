"""CachedDataset / CacheLoader: values equal the dataset's, caches are shared across processes, faults are harmless."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from bagua.torch_api.contrib import CacheLoader, CachedDataset
from bagua.torch_api.contrib.utils.serialization import decode

N = 24


class Samples(torch.utils.data.Dataset):
    """Deterministic samples of mixed types; ``forbidden=True`` fails on any read (to prove cache hits)."""

    def __init__(self, n: int = N, forbidden: bool = False, nbytes: int = 64):
        self.n, self.forbidden, self.nbytes = n, forbidden, nbytes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.forbidden:
            raise AssertionError(f"sample {i} was read from the dataset, not the cache")
        gen = torch.Generator().manual_seed(i)
        return {
            "x": torch.randn(self.nbytes // 4, generator=gen),
            "half": torch.randn(2, 3, generator=gen).to(torch.bfloat16),
            "mask": np.arange(4) % (i + 2) == 0,
            "label": i,
            "name": f"s{i}",
        }


def _assert_batches_equal(got, expected):
    assert got.keys() == expected.keys()
    for key in expected:
        if isinstance(expected[key], (torch.Tensor, np.ndarray)):
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)  # exact: nothing may change
            assert type(got[key]) is type(expected[key])
        else:
            assert got[key] == expected[key]


def _reference_batches(batch_size):
    return list(DataLoader(Samples(), batch_size=batch_size))


def _backend_kwargs(backend, tmp_path, redis_servers):
    if backend == "lmdb":
        return {"path": str(tmp_path / "cache.lmdb")}
    _, hosts = redis_servers(2)
    return {"hosts": hosts}


@pytest.mark.parametrize("backend", ["lmdb", pytest.param("redis", marks=pytest.mark.redis)])
def test_values_match_and_second_epoch_reads_only_the_cache(backend, tmp_path, redis_servers):
    kwargs = _backend_kwargs(backend, tmp_path, redis_servers)
    reference = _reference_batches(4)
    cached = CachedDataset(Samples(), backend=backend, dataset_name="mixed", **kwargs)
    first = list(DataLoader(cached, batch_size=4, num_workers=2))  # workers write, then exit (flushing)
    for got, expected in zip(first, reference, strict=True):
        _assert_batches_equal(got, expected)
    assert cached.cache_loader.num_keys() == N
    # new worker processes over a dataset that may not be read: every sample must come from the shared cache
    forbidden = Samples()
    from_cache = CachedDataset(forbidden, backend=backend, dataset_name="mixed", **kwargs)
    forbidden.forbidden = True  # after fingerprinting: the same dataset, which may no longer be read
    for got, expected in zip(DataLoader(from_cache, batch_size=4, num_workers=2), reference, strict=True):
        _assert_batches_equal(got, expected)
    for i in (0, 7, N - 1):  # single-item path too, in this process
        _assert_batches_equal(from_cache[i], Samples()[i])


def test_spawned_workers_share_the_lmdb_cache(tmp_path):
    path = str(tmp_path / "cache.lmdb")
    cached = CachedDataset(Samples(), dataset_name="spawned", path=path)
    cached[0]  # the parent holds an open handle; the pickled copies open their own
    loader = DataLoader(cached, batch_size=8, num_workers=1, multiprocessing_context="spawn")
    for got, expected in zip(loader, _reference_batches(8), strict=True):
        _assert_batches_equal(got, expected)
    assert cached.cache_loader.num_keys() == N


def test_pending_writes_are_flushed_when_workers_exit(tmp_path):
    path = str(tmp_path / "cache.lmdb")
    cached = CachedDataset(Samples(), dataset_name="lazy", writer_buffer_size=1000, path=path)
    list(DataLoader(cached, batch_size=None, num_workers=2))  # item by item: nothing reaches 1000 pending
    assert cached.cache_loader.num_keys() == N


def test_buffered_writes_reach_the_store_after_a_thousand_reads(tmp_path):
    """A buffer that never fills (3 keys, room for 50) is written after FLUSH_AFTER_READS reads, as the original's
    fetcher did, so that the other processes of the job see those values before this one exits."""
    from bagua.torch_api.contrib.cache_loader import FLUSH_AFTER_READS

    loader = CacheLoader(dataset_name="slow", writer_buffer_size=50, path=str(tmp_path / "cache.lmdb"))
    for read in range(FLUSH_AFTER_READS - 1):
        assert loader.get(read % 3, lambda k: k * 10) == (read % 3) * 10
    assert loader.num_keys() == 0  # still buffered
    loader.get(0, lambda k: k * 10)
    assert loader.num_keys() == 3 and loader.misses == 3


def test_datasets_share_a_store_by_name(tmp_path):
    path = str(tmp_path / "cache.lmdb")
    a = CachedDataset(Samples(), dataset_name="a", writer_buffer_size=1, path=path)
    b = CachedDataset(Samples(n=5), dataset_name="b", writer_buffer_size=1, path=path)
    for i in range(N):
        a[i]
    for i in range(5):
        b[i]
    assert a.cache_loader.num_keys() == N + 5 == b.cache_loader.num_keys()
    assert a.cache_loader.misses == N and a.cache_loader.hits == 0
    a[3]
    assert a.cache_loader.hits == 1


def test_corrupt_entry_is_recomputed_and_rewritten(tmp_path):
    loader = CacheLoader(dataset_name="c", writer_buffer_size=1, path=str(tmp_path / "cache.lmdb"))
    dataset = Samples()
    for i in range(4):
        loader.get(i, dataset.__getitem__)
    good = loader.store.get("c_2")
    loader.store.mset({"c_2": good[:-3] + b"\0\0\0", "c_3": b"\x80\x04pickle"})
    with pytest.warns(RuntimeWarning, match="corrupt") as record:
        _assert_batches_equal(loader.get(2, dataset.__getitem__), dataset[2])
        _assert_batches_equal(loader.get(3, dataset.__getitem__), dataset[3])
    assert len(record) == 1  # warned once, not per entry
    _assert_batches_equal(decode(loader.store.get("c_2")), dataset[2])  # rewritten with the right value
    _assert_batches_equal(decode(loader.store.get("c_3")), dataset[3])


def test_full_lmdb_falls_back_and_warns_once(tmp_path):
    dataset = Samples(n=40, nbytes=40_000)
    cached = CachedDataset(dataset, dataset_name="full", writer_buffer_size=2, retry_after_s=0,
                           path=str(tmp_path / "cache.lmdb"), map_size=512 * 1024)
    with pytest.warns(RuntimeWarning, match="full") as record:
        for _ in range(2):
            for i in range(len(dataset)):
                _assert_batches_equal(cached[i], dataset[i])
    assert len(record) == 1
    stored = cached.cache_loader.num_keys()
    assert 0 < stored < len(dataset)
    assert cached.cache_loader.hits >= stored  # what fitted is still served from the cache


@pytest.mark.redis
def test_redis_killed_mid_epoch_keeps_values_and_warns_once(redis_servers):
    (process,), hosts = redis_servers(1)
    dataset = Samples(n=60)
    loader = CacheLoader(backend="redis", dataset_name="k", writer_buffer_size=5, retry_after_s=0, hosts=hosts)
    with pytest.warns(RuntimeWarning, match="unavailable") as record:
        for epoch in range(2):
            for i in range(len(dataset)):
                if epoch == 1 and i == 30:
                    process.kill()
                    process.wait()
                _assert_batches_equal(loader.get(i, dataset.__getitem__), dataset[i])
    assert len(record) == 1
    assert loader.hits == 30 and loader.misses == 90  # epoch 0: all misses; epoch 1: hits until the kill


@pytest.mark.redis
def test_spawned_redis_backend_end_to_end():
    dataset = Samples()
    cached = CachedDataset(dataset, backend="redis", dataset_name="spawned", capacity_per_node=64 * 1024**2)
    try:
        for batch, expected in zip(DataLoader(cached, batch_size=6), _reference_batches(6), strict=True):
            _assert_batches_equal(batch, expected)
        assert cached.cache_loader.num_keys() == N
        for batch, expected in zip(DataLoader(cached, batch_size=6), _reference_batches(6), strict=True):
            _assert_batches_equal(batch, expected)
        assert cached.cache_loader.hits == N
    finally:
        cached.cache_loader.store.shutdown()


def test_validation(tmp_path, monkeypatch):
    monkeypatch.setenv("BAGUA_CACHE_DIR", str(tmp_path / "default"))  # the default directory, out of $HOME
    with pytest.raises(ValueError, match="available: \\['lmdb', 'redis'\\]"):
        CacheLoader(backend="memcached")
    with pytest.raises(ValueError, match="writer_buffer_size"):
        CacheLoader(writer_buffer_size=0, path=str(tmp_path))
    with pytest.warns(UserWarning, match="dataset_name"):
        CacheLoader(backend="lmdb")  # unnamed persistent cache: two datasets could collide
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CacheLoader(backend="lmdb", path=str(tmp_path / "x"))
    loader = CacheLoader(dataset_name="t", path=str(tmp_path / "y"))
    with pytest.raises(TypeError, match="cannot cache"):
        loader.get(0, lambda key: object())
