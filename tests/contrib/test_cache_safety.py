"""What fills a cache, who may write it, and what a record written by another tool can do.

- Fingerprints: two datasets, a changed transform or a new version under one cache directory and name each read
  their own samples (a changed fingerprint is a miss).
- Ownership: the default cache directory is per user and 0700; a directory or file another user owns, or that
  group or others may write, is refused (real ``chmod``/``chown``).
- Records written with raw ``lmdb`` or ``redis-cli``: a corrupted one is recomputed; a pickle is never
  unpickled (its payload would create a file); a well-formed forged one is served, which is the documented limit.
"""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import subprocess

import lmdb
import pytest
import torch

from bagua.torch_api.contrib import CachedDataset
from bagua.torch_api.contrib.utils.fingerprint import dataset_fingerprint
from bagua.torch_api.contrib.utils.serialization import decode, encode
from tests.contrib.test_cached_dataset import N, Samples, _assert_batches_equal


class Shifted(Samples):
    """Another dataset class with the same length and attributes as ``Samples``."""

    def __getitem__(self, i):
        sample = super().__getitem__(i)
        return {**sample, "label": sample["label"] + 1000}


class WithTransform(torch.utils.data.Dataset):
    def __init__(self, transform, n=N):
        self.transform, self.n = transform, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.transform(torch.full((3,), float(i)))


def _read_all(cached):
    return [cached[i] for i in range(len(cached))]


# -------------------------------------------------------------------------------------------- fingerprints


def test_two_datasets_in_the_default_cache_read_their_own_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("BAGUA_CACHE_DIR", str(tmp_path / "cache"))
    first = CachedDataset(Samples(), writer_buffer_size=1)  # default name and directory, as two jobs would
    _read_all(first)
    second = CachedDataset(Shifted(), writer_buffer_size=1)
    for i, sample in enumerate(_read_all(second)):
        _assert_batches_equal(sample, Shifted()[i])  # not the first dataset's samples
    assert second.cache_loader.hits == 0
    lists = [[torch.full((2,), float(i + shift)) for i in range(N)] for shift in (0, 100)]  # in-memory lists
    for data in lists:
        cached = CachedDataset(data, writer_buffer_size=1)
        assert [t.tolist() for t in _read_all(cached)] == [t.tolist() for t in data]
    again = CachedDataset(Samples(), writer_buffer_size=1)  # the same dataset again: served from the cache
    _read_all(again)
    assert again.cache_loader.hits == N and again.cache_loader.misses == 0


def test_changed_transform_or_version_is_a_miss_under_a_pinned_name(tmp_path):
    path = str(tmp_path / "cache.lmdb")

    def scale(factor):
        return lambda x: x * factor

    doubled = CachedDataset(WithTransform(scale(2)), dataset_name="pinned", writer_buffer_size=1, path=path)
    assert _read_all(doubled)[3].tolist() == [6.0] * 3
    tripled = CachedDataset(WithTransform(scale(3)), dataset_name="pinned", writer_buffer_size=1, path=path)
    assert _read_all(tripled)[3].tolist() == [9.0] * 3  # the closure changed: a miss, recomputed
    assert tripled.cache_loader.hits == 0
    negated = CachedDataset(WithTransform(lambda x: -x), dataset_name="pinned", writer_buffer_size=1, path=path)
    assert _read_all(negated)[3].tolist() == [-3.0] * 3  # another function
    same = CachedDataset(WithTransform(scale(2)), dataset_name="pinned", writer_buffer_size=1, path=path)
    assert _read_all(same)[3].tolist() == [6.0] * 3 and same.cache_loader.hits == N
    bumped = CachedDataset(WithTransform(scale(2)), dataset_name="pinned", version="v2", path=path)
    _read_all(bumped)
    assert bumped.cache_loader.hits == 0  # a new version invalidates


def test_fingerprint_is_stable_and_sees_what_changes_samples():
    assert dataset_fingerprint(Samples()) == dataset_fingerprint(Samples())  # no addresses, no randomness
    assert dataset_fingerprint(Samples()) != dataset_fingerprint(Samples(nbytes=128))  # an attribute
    assert dataset_fingerprint(Samples()) != dataset_fingerprint(Samples(n=N - 1))  # the length
    subsets = [torch.utils.data.Subset(Samples(), idx) for idx in ([0, 1, 2], [2, 1, 0])]
    assert dataset_fingerprint(subsets[0]) != dataset_fingerprint(subsets[1])  # indices of a wrapper
    assert dataset_fingerprint(Samples(), "a").digest != dataset_fingerprint(Samples(), "b").digest
    assert "class=tests.contrib.test_cached_dataset.Samples" in dataset_fingerprint(Samples()).description


# ----------------------------------------------------------------------------------------------- ownership


def test_default_directory_is_per_user_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv("BAGUA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cached = CachedDataset(Samples(), dataset_name="mine", writer_buffer_size=1)
    _read_all(cached)
    root = tmp_path / "xdg" / "bagua"
    assert cached.cache_loader.store.path == str(root / "mine.lmdb")
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "mine.lmdb").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "mine.lmdb" / "data.mdb").st_mode) == 0o600
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    from bagua.torch_api import env

    assert env.get_cache_dir() == str(tmp_path / "home" / ".cache" / "bagua")


@pytest.mark.parametrize("where", ["root", "database", "data file"])
def test_group_or_other_writable_cache_is_refused(tmp_path, monkeypatch, where):
    root = tmp_path / "cache"
    monkeypatch.setenv("BAGUA_CACHE_DIR", str(root))
    _read_all(CachedDataset(Samples(), dataset_name="d", writer_buffer_size=1))
    target = {"root": root, "database": root / "d.lmdb", "data file": root / "d.lmdb" / "data.mdb"}[where]
    os.chmod(target, 0o777 if target.is_dir() else 0o666)
    with pytest.raises(PermissionError, match=f"{target} is writable by group or others.*chmod go-w {target}"):
        CachedDataset(Samples(), dataset_name="d")
    os.chmod(target, 0o700 if target.is_dir() else 0o600)
    CachedDataset(Samples(), dataset_name="d")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("where", ["root", "path"])
def test_cache_of_another_user_is_refused(tmp_path, monkeypatch, where):
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)  # nobody
    kwargs = {"path": str(directory)} if where == "path" else {}
    monkeypatch.setenv("BAGUA_CACHE_DIR", str(directory))
    with pytest.raises(PermissionError, match=f"{directory} belongs to .*uid 65534.*not to you"):
        CachedDataset(Samples(), dataset_name="d", **kwargs)


# -------------------------------------------------------------- records written with another tool


class _CreatesFile:
    """Unpickling this runs ``open(path, "w")``: a file appears if anything ever unpickles the record."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _forged_records(tmp_path):
    good = encode(Samples()[2])
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x01
    payload = pickle.dumps(_CreatesFile(str(tmp_path / "pwned")))
    pickle.loads(pickle.dumps(_CreatesFile(str(tmp_path / "control"))))  # the payload is live
    assert (tmp_path / "control").exists()
    chosen = dict(Samples()[4], label=-1)  # well formed, valid CRC, chosen by whoever writes the store
    return {2: bytes(flipped), 3: payload, 4: encode(chosen)}


def _check_forged_reads(cached, tmp_path):
    dataset = Samples()
    with pytest.warns(RuntimeWarning, match="corrupt"):
        got = _read_all(cached)
    for i in (0, 1, 2, 3, 5):
        _assert_batches_equal(got[i], dataset[i])  # corrupted and pickled records: recomputed
    assert not (tmp_path / "pwned").exists()  # the pickle was never unpickled
    assert got[4]["label"] == -1  # the documented limit: a well-formed forged record is served
    _assert_batches_equal(decode(cached.cache_loader.store.get(cached.cache_loader.key(2))), dataset[2])


def test_records_written_with_raw_lmdb(tmp_path):
    path = str(tmp_path / "cache.lmdb")
    cached = CachedDataset(Samples(), dataset_name="d", writer_buffer_size=1, path=path)
    _read_all(cached)
    cached.cache_loader.flush()
    cached.cache_loader.store.shutdown()  # one handle per process: let the raw tool open it
    env = lmdb.open(path, map_size=1 << 30)
    with env.begin(write=True) as txn:
        for index, value in _forged_records(tmp_path).items():
            assert txn.get(cached.cache_loader.key(index).encode()) is not None
            txn.put(cached.cache_loader.key(index).encode(), value)
    env.close()
    _check_forged_reads(CachedDataset(Samples(), dataset_name="d", writer_buffer_size=1, path=path), tmp_path)


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="needs redis-cli (Debian redis-tools, a dependency "
                    "of redis-server)")
def test_records_written_with_redis_cli(tmp_path, redis_servers):
    _, hosts = redis_servers(1)
    host = hosts[0]
    cached = CachedDataset(Samples(), backend="redis", dataset_name="d", writer_buffer_size=1, hosts=hosts)
    _read_all(cached)
    cached.cache_loader.flush()
    for index, value in _forged_records(tmp_path).items():
        subprocess.run([shutil.which("redis-cli"), "-h", host["host"], "-p", str(host["port"]), "--no-auth-warning",
                        "-a", host["password"], "-x", "SET", cached.cache_loader.key(index)],
                       input=value, check=True, capture_output=True, timeout=30)
    again = CachedDataset(Samples(), backend="redis", dataset_name="d", writer_buffer_size=1, hosts=hosts)
    _check_forged_reads(again, tmp_path)
