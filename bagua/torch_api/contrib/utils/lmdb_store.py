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
  and commits nothing;
- a data file shorter than its last committed page (a full disk, a killed copy, a bad restore) must never be
  mapped: touching a page past the end of the file raises SIGBUS, which kills the process (and every elastic
  restart after it). So the first process to open an environment, the one that finds no other process using it,
  checks the file's header and length against LMDB's meta pages (without mapping it) and catches LMDB's own
  "invalid"/"corrupted" errors; a damaged file is renamed aside (``data.mdb.damaged-<time>-<pid>``), a
  ``RuntimeWarning`` says where, and the cache starts empty, so samples are recomputed from the dataset.

The directory and its files must belong to the user and not be writable by group or others
(:mod:`~bagua.torch_api.contrib.utils.private_dir`): whoever writes the cache chooses the samples read from it.

Example:
    >>> import tempfile
    >>> store = LmdbStore(tempfile.mkdtemp(), map_size=1 << 20)
    >>> store.mset({"a": b"1", "b": b"2"})
    >>> store.mget(["b", "c"])
    [b'2', None]
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
import time
import warnings
from typing import Any, Iterator, Mapping, Optional, Sequence

from bagua.torch_api.contrib.utils.private_dir import ensure_private_dir
from bagua.torch_api.contrib.utils.store import Store, StoreError, StoreFullError

try:
    import lmdb
except ImportError:  # a broken install: lmdb is one of bagua's dependencies
    lmdb = None

__all__ = ["LmdbStore", "DEFAULT_MAP_SIZE", "lmdb_file_damage"]

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


# LMDB 0.9's on-disk meta page (lmdb.h / mdb.c, MDB_DATA_VERSION 1), native layout: the page header (pgno, pad,
# flags, lower/upper), then magic, version, address, mapsize, two MDB_db records (the first one's md_pad is the
# page size), the last used page and the transaction id. Both meta pages (pages 0 and 1) must be valid, as
# mdb_env_read_header requires; the one with the larger transaction id is current.
_META = struct.Struct("@NHHI" "IIPN" + "IHHNNNNN" * 2 + "NN")
_P_META, _MAGIC, _DATA_VERSION = 0x08, 0xBEEFC0DE, 1
_DATA, _LOCK_FILE = "data.mdb", "lock.mdb"


def lmdb_file_damage(data_file: str) -> Optional[str]:
    """Why ``data_file`` (an LMDB ``data.mdb``) cannot be mapped safely, or ``None`` when it can (or is absent).

    Reads the two meta pages with plain reads (never a memory map) and checks their magic, version and page size,
    and that the file reaches the end of the last committed page.

    Args:
        data_file: path of the data file.

    Returns:
        A short reason, or ``None``.

    Example:
        >>> lmdb_file_damage("/nonexistent/data.mdb") is None
        True
    """
    try:
        size = os.path.getsize(data_file)
        if size == 0:
            return None  # LMDB initializes an empty file as a new database
        with open(data_file, "rb") as f:
            metas = []
            offset = 0
            for _ in range(2):
                f.seek(offset)
                raw = f.read(_META.size)
                if len(raw) < _META.size:
                    return f"truncated inside its header ({size} bytes)"
                fields = _META.unpack(raw)
                flags, magic, version, page_size = fields[2], fields[4], fields[5], fields[8]
                if not flags & _P_META or magic != _MAGIC:
                    return "not an LMDB file, or its header is overwritten"
                if version != _DATA_VERSION:
                    return f"LMDB data version {version}, expected {_DATA_VERSION}"
                if page_size < 512 or page_size > 65536 or page_size & (page_size - 1):
                    return f"a header with an impossible page size {page_size}"
                metas.append((fields[-1], fields[-2], page_size))  # (txnid, last page, page size)
                offset = page_size
    except OSError as error:
        if error.errno == errno.ENOENT:
            return None
        return f"unreadable ({error})"
    _, last_page, page_size = max(metas)
    needed = (last_page + 1) * page_size
    if size < needed:
        return f"truncated: {size} bytes, but its last committed page ends at byte {needed}"
    return None


# LMDB errors that mean the files are not a usable database (as opposed to a full map or too many readers)
_DAMAGE_ERRORS = tuple(getattr(lmdb, n) for n in ("InvalidError", "CorruptedError", "VersionMismatchError",
                                                   "PageNotFoundError", "PanicError")) if lmdb else ()


@contextlib.contextmanager
def _sole_opener(path: str) -> Iterator[bool]:
    """Serialize openers of ``path`` across processes; yield whether no process has the environment open.

    Every open LMDB environment holds a shared ``fcntl`` lock on byte 0 of its lock file (``mdb_env_excl_lock``),
    so an exclusive lock on that byte succeeds only when no process uses the database. Openers first take an
    exclusive ``flock`` on the directory, so two of them never check and rename at once.
    """
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)
        sole = True
        try:
            lock_fd = os.open(os.path.join(path, _LOCK_FILE), os.O_RDWR)
        except FileNotFoundError:
            lock_fd = None
        if lock_fd is not None:
            try:
                fcntl.lockf(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
            except OSError:
                sole = False
            finally:
                os.close(lock_fd)  # drops our fcntl lock; this process has no environment open on it yet
        yield sole
    finally:
        os.close(dir_fd)  # releases the flock


def _move_aside(path: str, reason: str) -> None:
    suffix = f".damaged-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}"
    moved = os.path.join(path, _DATA + suffix)
    os.replace(os.path.join(path, _DATA), moved)
    with contextlib.suppress(FileNotFoundError):
        os.replace(os.path.join(path, _LOCK_FILE), os.path.join(path, _LOCK_FILE + suffix))
    warnings.warn(f"the LMDB cache file {os.path.join(path, _DATA)} is damaged ({reason}); moved it to {moved} "
                  "and started an empty cache: samples are recomputed from the dataset. Delete the moved file "
                  "when you no longer need it", RuntimeWarning, stacklevel=2)


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
        self.path = ensure_private_dir(path, files=(_DATA, _LOCK_FILE))
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
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            with _sole_opener(self.path) as sole:
                reason = lmdb_file_damage(os.path.join(self.path, _DATA)) if sole else None
                if reason is not None:
                    _move_aside(self.path, reason)
                try:
                    env = self._open()
                except _DAMAGE_ERRORS as error:
                    if not sole:
                        raise
                    _move_aside(self.path, f"LMDB: {error}")
                    env = self._open()
        except (lmdb.Error, OSError) as error:
            raise StoreError(f"cannot open LMDB cache at {self.path}: {error}") from error
        _OPEN[self.path] = (os.getpid(), env)
        return env

    def _open(self) -> Any:
        return lmdb.open(
            self.path,
            map_size=self.map_size,
            max_readers=self.max_readers,
            mode=0o600,  # the files: readable and writable by this user only
            readahead=False,  # random sample access: let the OS fetch only the pages asked for
            meminit=False,
            sync=False,  # a cache: losing the last commits on an OS crash only costs recomputation
            metasync=False,
        )

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
