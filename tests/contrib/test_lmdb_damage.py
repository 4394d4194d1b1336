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

# Reads every sample twice through the cache and checks each against the dataset; prints the counts.
_READER = """
import json, sys, warnings
import torch
from bagua.torch_api.contrib import CachedDataset
from tests.contrib.test_cached_dataset import Samples, _assert_batches_equal
warnings.simplefilter("always")
dataset = Samples(nbytes=int(sys.argv[2]))
cached = CachedDataset(dataset, dataset_name="d", writer_buffer_size=1, path=sys.argv[1])
for _ in range(2):
    for i in range(len(dataset)):
        _assert_batches_equal(cached[i], dataset[i])
loader = cached.cache_loader
print(json.dumps({"hits": loader.hits, "misses": loader.misses, "keys": loader.num_keys()}))
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


# (name, where to cut the data file, given its size and page size 4096)
CUTS = [
    ("inside the first meta page", lambda size: 100),
    ("inside the second meta page", lambda size: 4096 + 50),
    ("in the middle of a data page", lambda size: size // 2 + 123),
    ("one page short", lambda size: size - 4096),
]


@pytest.mark.parametrize("name, cut", CUTS, ids=[c[0] for c in CUTS])
def test_truncated_cache_is_moved_aside_and_rebuilt(tmp_path, full_cache, name, cut):
    path = tmp_path / "cache.lmdb"
    shutil.copytree(full_cache, path)
    size = _data_size(path)
    os.truncate(path / "data.mdb", cut(size))
    assert lmdb_file_damage(str(path / "data.mdb")) is not None
    if cut(size) > 2 * 4096:  # the fault is real: a plain LMDB reader of this file dies of SIGBUS
        assert _run(_RAW_READER, path).returncode == -signal.SIGBUS

    result = _run(_READER, path, NBYTES)
    assert result.returncode == 0, f"reader failed (return code {result.returncode}):\n{result.stderr[-3000:]}"
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts == {"hits": N, "misses": N, "keys": N}  # rebuilt from the dataset, then served from the cache
    moved = glob.glob(str(path / "data.mdb.damaged-*"))
    assert len(moved) == 1 and os.path.getsize(moved[0]) == cut(size)  # the broken file, kept for inspection
    assert f"moved it to {moved[0]}" in result.stderr  # the warning says where
    assert lmdb_file_damage(str(path / "data.mdb")) is None

    if name == "in the middle of a data page":  # the next run (an elastic restart) reads the rebuilt cache
        again = _run(_READER, path, NBYTES)
        assert again.returncode == 0 and json.loads(again.stdout.strip().splitlines()[-1])["hits"] == 2 * N
        assert len(glob.glob(str(path / "data.mdb.damaged-*"))) == 1


def test_overwritten_header_is_moved_aside(tmp_path, full_cache):
    path = tmp_path / "cache.lmdb"
    shutil.copytree(full_cache, path)
    with open(path / "data.mdb", "r+b") as f:  # a bad restore: another file's bytes over the start
        f.write(b"\x89PNG\r\n\x1a\n" * 64)
    result = _run(_READER, path, NBYTES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not an LMDB file" in result.stderr
    assert len(glob.glob(str(path / "data.mdb.damaged-*"))) == 1


def test_empty_and_intact_files_are_kept(tmp_path, full_cache):
    path = tmp_path / "cache.lmdb"
    shutil.copytree(full_cache, path)
    assert lmdb_file_damage(str(path / "data.mdb")) is None
    result = _run(_READER, path, NBYTES)
    assert result.returncode == 0 and json.loads(result.stdout.strip().splitlines()[-1])["hits"] == 2 * N
    os.truncate(path / "data.mdb", 0)  # LMDB starts an empty file afresh: nothing to move
    assert lmdb_file_damage(str(path / "data.mdb")) is None
    assert _run(_READER, path, NBYTES).returncode == 0
    assert not glob.glob(str(path / "data.mdb.damaged-*"))


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
        result = _run(_READER, path, NBYTES)
        assert result.returncode == 0 and json.loads(result.stdout.strip().splitlines()[-1])["hits"] == 2 * N
        assert not glob.glob(str(path / "data.mdb.damaged-*"))
    finally:
        holder.kill()
        holder.wait()
    with _sole_opener(str(path)) as sole:
        assert sole
