"""A damaged LMDB cache file (truncated, overwritten header) is moved aside and rebuilt, never mapped.

The fault is real: the file on disk is truncated with ``os.truncate``. Every reader runs in a subprocess, so a
SIGBUS from a page past the end of the file fails the test instead of killing pytest.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from bagua.torch_api.contrib import CachedDataset
from bagua.torch_api.contrib.utils.lmdb_store import lmdb_file_damage
from tests.contrib.test_cached_dataset import N, Samples

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NBYTES = 4000  # ~100 KiB of samples: a few dozen pages, so a cut can fall inside one

# Reads every sample twice through the cache at each path and checks each against the dataset; prints the counts.
_READER = """
import json, sys, warnings
import torch
from bagua.torch_api.contrib import CachedDataset
from tests.contrib.test_cached_dataset import Samples, _assert_batches_equal
warnings.simplefilter("always")
dataset = Samples(nbytes=int(sys.argv[1]))
for path in sys.argv[2:]:
    cached = CachedDataset(dataset, dataset_name="d", writer_buffer_size=1, path=path)
    for _ in range(2):
        for i in range(len(dataset)):
            _assert_batches_equal(cached[i], dataset[i])
    loader = cached.cache_loader
    print(json.dumps({"hits": loader.hits, "misses": loader.misses, "keys": loader.num_keys()}), flush=True)
"""

# What a plain LMDB reader does with the same file: walks every entry.
_RAW_READER = """
import sys, lmdb
env = lmdb.open(sys.argv[1], map_size=1 << 30)
with env.begin() as txn:
    print(sum(len(v) for _, v in txn.cursor()))
"""


def _run(script, *args):
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def full_cache(tmp_path_factory):
    """A complete cache of every sample, written once; tests damage copies of it."""
    path = tmp_path_factory.mktemp("full") / "cache.lmdb"
    cached = CachedDataset(Samples(nbytes=NBYTES), dataset_name="d", writer_buffer_size=1, path=str(path))
    for i in range(N):
        cached[i]
    cached.cache_loader.flush()
    cached.cache_loader.store.shutdown()
    return path


def _data_size(path):
    return os.path.getsize(path / "data.mdb")


def _overwrite_header(data_file):
    with open(data_file, "r+b") as f:  # a bad restore: another file's bytes over the start
        f.write(b"\x89PNG\r\n\x1a\n" * 64)


# (name, damage done to the data file given its size (page size 4096), what the check must say or None)
DAMAGES = [
    ("cut inside the first meta page", lambda f, size: os.truncate(f, 100), "truncated inside its header"),
    ("cut inside the second meta page", lambda f, size: os.truncate(f, 4096 + 50), "truncated inside its header"),
    ("cut in the middle of a data page", lambda f, size: os.truncate(f, size // 2 + 123), "truncated: "),
    ("cut one page short", lambda f, size: os.truncate(f, size - 4096), "truncated: "),
    ("header overwritten", lambda f, size: _overwrite_header(f), "not an LMDB file"),
    ("emptied (LMDB starts afresh)", lambda f, size: os.truncate(f, 0), None),
    ("intact", lambda f, size: None, None),
]


def _read(*paths):
    """Run the reader over ``paths`` in one subprocess; return its per-path counts and stderr."""
    result = _run(_READER, NBYTES, *paths)
    assert result.returncode == 0, f"reader failed (return code {result.returncode}):\n{result.stderr[-3000:]}"
    return [json.loads(line) for line in result.stdout.strip().splitlines()], result.stderr


def test_damaged_cache_is_moved_aside_and_rebuilt(tmp_path, full_cache):
    paths = []
    for number, (name, damage, reason) in enumerate(DAMAGES):
        path = tmp_path / str(number) / "cache.lmdb"
        shutil.copytree(full_cache, path)
        size = _data_size(path)
        damage(path / "data.mdb", size)
        found = lmdb_file_damage(str(path / "data.mdb"))
        assert (found is None) if reason is None else (reason in found), (name, found)
        if reason is not None:  # the fault is real: plain LMDB dies of SIGBUS past the end, or fails to open
            code = _run(_RAW_READER, path).returncode
            assert code == -signal.SIGBUS if reason == "truncated: " else code == 1, (name, code)
        paths.append(path)

    sizes = [_data_size(path) for path in paths]
    counts, stderr = _read(*paths)  # one process, as a run that opens several caches
    for path, size, got, (name, _, reason) in zip(paths, sizes, counts, DAMAGES, strict=True):
        moved = glob.glob(str(path / "data.mdb.damaged-*"))
        if name == "intact":
            assert got == {"hits": 2 * N, "misses": 0, "keys": N} and not moved
            continue
        assert got == {"hits": N, "misses": N, "keys": N}, name  # rebuilt from the dataset, then served from it
        if reason is None:
            assert not moved, name
            continue
        assert len(moved) == 1 and os.path.getsize(moved[0]) == size, name  # the broken file, kept aside
        assert f"moved it to {moved[0]}" in stderr, name  # the warning says where
        assert lmdb_file_damage(str(path / "data.mdb")) is None, name

    counts, _ = _read(*paths)  # the next run (an elastic restart) reads the rebuilt caches
    assert [got["hits"] for got in counts] == [2 * N] * len(paths)
    assert [len(glob.glob(str(p / "data.mdb.damaged-*"))) for p in paths] == [1] * 5 + [0, 0]


def test_only_the_sole_opener_checks(tmp_path, full_cache):
    """A database another process has open is never checked or renamed under it: the check runs when the first
    process opens it, before any process maps the file."""
    from bagua.torch_api.contrib.utils.lmdb_store import _sole_opener

    path = tmp_path / "cache.lmdb"
    shutil.copytree(full_cache, path)
    with _sole_opener(str(path)) as sole:
        assert sole
    holder = subprocess.Popen(
        [sys.executable, "-c", "import lmdb, sys, time; env = lmdb.open(sys.argv[1], map_size=1 << 30); "
         "print('open', flush=True); time.sleep(60)", str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with _sole_opener(str(path)) as sole:
            assert not sole
        counts, _ = _read(path)
        assert counts[0]["hits"] == 2 * N
        assert not glob.glob(str(path / "data.mdb.damaged-*"))
    finally:
        holder.kill()
        holder.wait()
    with _sole_opener(str(path)) as sole:
        assert sole
