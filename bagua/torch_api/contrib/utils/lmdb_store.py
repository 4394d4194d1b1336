"""LmdbStore: the embedded, node-local default store of the dataset cache.

LMDB (Lightning Memory-Mapped Database, https://www.symas.com/lmdb) is a B+tree in one memory-mapped file. Readers
in any number of processes read the page cache directly, without copies through a server or locks; one writer at a
time commits, and a process that dies mid-transaction leaves the database at its last commit. So every DataLoader
worker and every local rank of a node can share one cache, and it outlives worker restarts, with nothing to
install beyond the ``lmdb`` wheel and nothing to start.

Three LMDB rules shape this module:

- an environment is opened at most once per process: handles live in one per-process table keyed by path and
  are shared by every ``LmdbStore`` on that path;
- a handle must not cross ``fork()``, and a child must not close an inherited one either (``mdb_env_close``
  would free the parent's reader slots, which we measured). So every handle is closed just *before* a fork
  (``os.register_at_fork``), with no transaction in flight (transactions hold the table's lock), and both sides
  reopen lazily. A handle seen in a process that did not open it (a fork that bypassed the hooks) is never used:
  the store reports a fault instead;
- the map has a fixed maximum size (``map_size``); a write that does not fit raises :class:`StoreFullError`
  and commits nothing.

Example:
    >>> import tempfile
    >>> store = LmdbStore(tempfile.mkdtemp(), map_size=1 << 20)
    >>> store.mset({"a": b"1", "b": b"2"})
    >>> store.mget(["b", "c"])
    [b'2', None]
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator, Mapping, Optional, Sequence

from bagua.torch_api.contrib.utils.store import Store, StoreError, StoreFullError

try:
    import lmdb
except ImportError:  # a broken install: lmdb is one of bagua's dependencies
    lmdb = None

__all__ = ["LmdbStore", "DEFAULT_MAP_SIZE"]

#: Address space reserved per dataset; the file only grows as entries are written. Pass ``map_size`` to change it.
DEFAULT_MAP_SIZE = 64 * 1024**3

# path -> (pid that opened it, environment). Every transaction runs under _LOCK, so the fork hook below can
# close the handles knowing that none is in use.
_OPEN: dict[str, tuple[int, Any]] = {}
_LOCK = threading.Lock()


def _close_before_fork() -> None:
    _LOCK.acquire()
    for pid, env in list(_OPEN.values()):
        if pid == os.getpid():
            env.close()
    _OPEN.clear()


def _release_after_fork() -> None:
    _LOCK.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_close_before_fork, after_in_parent=_release_after_fork, after_in_child=_release_after_fork
    )


class LmdbStore(Store):
    """A ``str -> bytes`` store in one LMDB environment (a directory), shared by every process that opens it.

    Args:
        path: directory of the environment; created if missing.
        map_size: largest size in bytes the database may reach; writes beyond it raise :class:`StoreFullError`.
            The first process to open the directory sets it.
        max_readers: concurrent read transactions allowed across all processes (workers x ranks per node).

    Example:
        See the module docstring.
    """

    def __init__(self, path: str, map_size: int = DEFAULT_MAP_SIZE, max_readers: int = 512) -> None:
        if lmdb is None:
            raise ImportError("the default cache backend needs the 'lmdb' package, a dependency of bagua that is "
                              "missing here: pip install lmdb (or reinstall bagua), or use backend='redis'")
        if map_size <= 0:
            raise ValueError(f"map_size={map_size} must be a positive number of bytes, e.g. {DEFAULT_MAP_SIZE}")
        if max_readers <= 0:
            raise ValueError(f"max_readers={max_readers} must be positive")
        self.path = os.path.abspath(path)
        self.map_size = int(map_size)
        self.max_readers = int(max_readers)

    @contextlib.contextmanager
    def _transaction(self, write: bool) -> Iterator[Any]:
        """Yield a transaction on this process's handle, opening the environment if needed."""
        with _LOCK:
            env = self._environment()
            with env.begin(write=write, buffers=False) as txn:
                yield txn

    def _environment(self) -> Any:
        entry = _OPEN.get(self.path)
        if entry is not None:
            if entry[0] != os.getpid():
                raise StoreError(f"LMDB cache at {self.path} was opened by process {entry[0]} before a fork that "
                                 "bypassed os.register_at_fork hooks; it cannot be used in this process")
            return entry[1]
        try:
            os.makedirs(self.path, exist_ok=True)
            env = lmdb.open(
                self.path,
                map_size=self.map_size,
                max_readers=self.max_readers,
                readahead=False,  # random sample access: let the OS fetch only the pages asked for
                meminit=False,
                sync=False,  # a cache: losing the last commits on an OS crash only costs recomputation
                metasync=False,
            )
        except (lmdb.Error, OSError) as error:
            raise StoreError(f"cannot open LMDB cache at {self.path}: {error}") from error
        _OPEN[self.path] = (os.getpid(), env)
        return env

    def mset(self, mapping: Mapping[str, bytes]) -> None:
        if not mapping:
            return
        items = [(key.encode(), bytes(value)) for key, value in mapping.items()]
        try:
            with self._transaction(write=True) as txn:
                txn.cursor().putmulti(items)
        except lmdb.MapFullError as error:
            raise StoreFullError(
                f"LMDB cache at {self.path} is full (map_size={self.map_size} bytes); pass a larger map_size"
            ) from error
        except lmdb.Error as error:
            raise StoreError(f"LMDB write failed at {self.path}: {error}") from error

    def mget(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        try:
            with self._transaction(write=False) as txn:
                return [txn.get(key.encode()) for key in keys]
        except lmdb.Error as error:
            raise StoreError(f"LMDB read failed at {self.path}: {error}") from error

    def num_keys(self) -> int:
        try:
            with _LOCK:
                return int(self._environment().stat()["entries"])
        except lmdb.Error as error:
            raise StoreError(f"LMDB stat failed at {self.path}: {error}") from error

    def clear(self) -> None:
        try:
            with _LOCK:
                env = self._environment()
                with env.begin(write=True) as txn:
                    txn.drop(env.open_db(txn=txn), delete=False)
        except lmdb.Error as error:
            raise StoreError(f"LMDB clear failed at {self.path}: {error}") from error

    def shutdown(self) -> None:
        """Close this process's handle on the path, for every store sharing it; the files stay, a call reopens."""
        with _LOCK:
            entry = _OPEN.pop(self.path, None)
            if entry is not None and entry[0] == os.getpid():
                entry[1].close()
