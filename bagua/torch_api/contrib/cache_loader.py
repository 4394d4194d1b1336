"""CacheLoader: memoize an expensive ``key -> value`` function in a store shared by the processes of a job.

A *store fault* is a store that is down, unreachable, full, or holds an entry that does not decode. On a fault the
loader never returns a wrong value and never loses one: it computes the value with ``load_fn``, warns once per
kind of fault, and leaves the store alone for ``retry_after_s`` seconds before trying it again. A corrupt entry is
recomputed and rewritten.

:meth:`CacheLoader.get_many` (what ``CachedDataset`` serves a DataLoader batch with) reads a whole batch with one
request per store and writes its misses with one more. :meth:`CacheLoader.get` buffers new values and writes them
in one batch every ``writer_buffer_size`` values. Whatever is still buffered is written when the process exits,
DataLoader workers included (through :class:`multiprocessing.util.Finalize`, which they run).

Example:
    >>> import tempfile
    >>> loader = CacheLoader(dataset_name="squares", path=tempfile.mkdtemp())
    >>> loader.get(3, lambda k: k * k)
    9
    >>> loader.flush(); loader.num_keys()
    1
"""

from __future__ import annotations

import multiprocessing.util
import os
import time
import warnings
from typing import Any, Callable, Hashable, Optional, Sequence, Union

from bagua.torch_api.contrib.utils.fingerprint import Fingerprint
from bagua.torch_api.contrib.utils.serialization import CorruptEntryError, decode, encode
from bagua.torch_api.contrib.utils.store import Store, StoreError, StoreFullError

__all__ = ["CacheLoader", "BACKENDS", "FLUSH_AFTER_READS"]

#: Backend names accepted by ``CacheLoader(backend=...)``; a :class:`Store` instance is accepted too.
BACKENDS = ("lmdb", "redis")
#: :meth:`CacheLoader.get` writes what it buffered after this many reads even when the buffer is not full, as the
#: original's fetcher did: otherwise the last few misses of an epoch would stay in one process's buffer (invisible
#: to the other processes of the job) until it exits.
FLUSH_AFTER_READS = 1000


def _make_store(backend: Union[str, Store], dataset_name: str, fingerprinted: bool, kwargs: dict) -> Store:
    if isinstance(backend, Store):
        if kwargs:
            raise ValueError(f"options {sorted(kwargs)} only apply to a named backend, not to a Store instance")
        return backend
    if backend == "lmdb":
        from bagua.torch_api import env
        from bagua.torch_api.contrib.utils.lmdb_store import LmdbStore
        from bagua.torch_api.contrib.utils.private_dir import ensure_private_dir

        if "path" not in kwargs:
            if not dataset_name and not fingerprinted:
                warnings.warn(
                    "the LMDB cache persists across runs under BAGUA_CACHE_DIR and is shared by name; give each "
                    "function a distinct dataset_name or fingerprint= (or path=) so that two never read each "
                    "other's values",
                    stacklevel=4,
                )
            root = ensure_private_dir(env.get_cache_dir())  # per user, 0700; refused if others can write it
            kwargs = {**kwargs, "path": os.path.join(root, f"{dataset_name or 'default'}.lmdb")}
        return LmdbStore(**kwargs)
    if backend == "redis":
        from bagua.torch_api.contrib.utils.redis_store import RedisStore

        return RedisStore(**kwargs)
    raise ValueError(f"unknown cache backend {backend!r}; available: {list(BACKENDS)} or a Store instance")


class CacheLoader:
    """Return ``load_fn(key)`` from a shared cache, computing and storing it on a miss.

    Args:
        backend: ``"lmdb"`` (default: embedded, node-local, shared by every process of the node), ``"redis"``, or a
            :class:`~bagua.torch_api.contrib.utils.store.Store`.
        dataset_name: prefix of every key and, for LMDB, the name of the database directory under
            ``BAGUA_CACHE_DIR`` (default ``~/.cache/bagua``); give each dataset its own.
        writer_buffer_size: new values :meth:`get` buffers before one batched write (``get_many`` writes per call);
            what is buffered is written after :data:`FLUSH_AFTER_READS` reads at the latest.
        retry_after_s: seconds the store is left alone after a fault.
        fingerprint: what fills the cache (a string such as a version, or a
            :class:`~bagua.torch_api.contrib.utils.fingerprint.Fingerprint`); its hash goes into every key
            (``"{dataset_name}_{hash}_{key}"``), so values stored under another fingerprint are misses. ``None``
            keeps the original keys ``"{dataset_name}_{key}"``. ``CachedDataset`` passes the dataset's.
        **kwargs: backend options: LMDB ``path``, ``map_size``, ``max_readers``; Redis ``hosts``, ``cluster_mode``,
            ``capacity_per_node``, ``maxmemory_policy``, ``bind``, ``socket_timeout``.

    Example:
        See the module docstring.
    """

    def __init__(
        self,
        backend: Union[str, Store] = "lmdb",
        dataset_name: str = "",
        writer_buffer_size: int = 1,
        retry_after_s: float = 10.0,
        fingerprint: Union[str, Fingerprint, None] = None,
        **kwargs: Any,
    ) -> None:
        if writer_buffer_size < 1:
            raise ValueError(f"writer_buffer_size={writer_buffer_size} must be at least 1 (1 writes every value)")
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s={retry_after_s} must be >= 0 seconds")
        # user settings
        self.backend = backend if isinstance(backend, str) else type(backend).__name__
        self.dataset_name = dataset_name
        self.writer_buffer_size = writer_buffer_size
        self.retry_after_s = retry_after_s
        self.fingerprint = Fingerprint.of(fingerprint) if isinstance(fingerprint, str) else fingerprint
        # internal state: the store, this process's pending writes and fault bookkeeping
        self.store = _make_store(backend, dataset_name, fingerprint is not None, dict(kwargs))
        self._prefix = f"{dataset_name}_" if fingerprint is None else f"{dataset_name}_{self.fingerprint.digest}_"
        self._pending: dict[str, bytes] = {}
        self._reads_since_flush = 0
        self._finalizer_pid = -1
        self._reads_blocked_until = 0.0
        self._writes_blocked_until = 0.0
        self._warned: set[str] = set()
        # stats, per process
        self.hits = 0
        self.misses = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pending"], state["_finalizer_pid"], state["_reads_since_flush"] = {}, -1, 0
        return state

    def get(self, key: Hashable, load_fn: Callable[[Any], Any]) -> Any:
        """Return the value of ``key``: from the cache, else ``load_fn(key)`` (then buffered for writing).

        Args:
            key: any key whose ``str`` is stable and distinct, such as a sample index.
            load_fn: computes the value of a key; its result must be serializable (see ``serialization``).

        Returns:
            The value.
        """
        value = self._lookup([key], load_fn)[0]
        self._reads_since_flush += 1
        if len(self._pending) >= self.writer_buffer_size or self._reads_since_flush >= FLUSH_AFTER_READS:
            self.flush()
        return value

    def get_many(self, keys: Sequence[Hashable], load_fn: Callable[[Any], Any]) -> list:
        """Return the values of ``keys`` in order: one batched read, then one batched write of the misses.

        Args:
            keys: the keys (e.g. the indices of one batch).
            load_fn: computes the value of one key.

        Returns:
            A list of values, ``load_fn(k)`` for every ``k`` of ``keys``.
        """
        values = self._lookup(list(keys), load_fn)
        self.flush()
        return values

    def key(self, key: Hashable) -> str:
        """The store key of ``key``: ``"{dataset_name}_{fingerprint hash}_{key}"`` (without a fingerprint,
        ``"{dataset_name}_{key}"``)."""
        return f"{self._prefix}{key}"

    def num_keys(self) -> int:
        """Number of keys in the store (every dataset sharing it counted); pending writes are not."""
        return self.store.num_keys()

    def flush(self) -> None:
        """Write the buffered values now (dropping them on a store fault: they are only a cache)."""
        self._reads_since_flush = 0
        if not self._pending:
            return
        batch = dict(self._pending)
        self._pending.clear()  # the same dict stays registered with the exit-time flush
        if time.monotonic() < self._writes_blocked_until:
            return
        try:
            self.store.mset(batch)
        except StoreFullError as error:
            self._writes_blocked_until = time.monotonic() + self.retry_after_s
            self._warn_once("full", f"cache store is full; new samples are not cached ({error})")
        except StoreError as error:
            self._block_store()
            self._warn_once("down", f"cache store is unavailable; reading from the dataset instead ({error})")

    # ---------------------------------------------------------------------------------------------- internals

    def _lookup(self, keys: list, load_fn: Callable[[Any], Any]) -> list:
        names = [self.key(key) for key in keys]
        out = []
        for key, name, raw in zip(keys, names, self._read(names)):
            value = self._decoded(name, raw)
            if value is _MISS:
                self.misses += 1
                value = load_fn(key)
                self._buffer(name, value)
            else:
                self.hits += 1
            out.append(value)
        return out

    def _read(self, names: list[str]) -> list[Optional[bytes]]:
        if time.monotonic() < self._reads_blocked_until:
            return [None] * len(names)
        try:
            raws = self.store.mget(names)
        except StoreError as error:
            self._block_store()
            self._warn_once("down", f"cache store is unavailable; reading from the dataset instead ({error})")
            return [None] * len(names)
        return list(raws)

    def _decoded(self, name: str, raw: Optional[bytes]) -> Any:
        if raw is None:
            raw = self._pending.get(name)
            if raw is None:
                return _MISS
        try:
            return decode(raw)
        except CorruptEntryError as error:
            self._warn_once("corrupt", f"cache entry {name!r} is corrupt and is recomputed ({error})")
            return _MISS

    def _buffer(self, name: str, value: Any) -> None:
        self._pending[name] = encode(value)
        if self._finalizer_pid != os.getpid():
            # Runs when this loader is collected or this process exits, DataLoader workers included (they skip
            # atexit handlers but run multiprocessing finalizers). It holds the store and the buffer, not the loader.
            multiprocessing.util.Finalize(self, _write_pending, args=(self.store, self._pending), exitpriority=10)
            self._finalizer_pid = os.getpid()

    def _block_store(self) -> None:
        until = time.monotonic() + self.retry_after_s
        self._reads_blocked_until = self._writes_blocked_until = until

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


def _write_pending(store: Store, pending: dict[str, bytes]) -> None:
    if pending:
        try:
            store.mset(dict(pending))
        except StoreError:
            pass  # only a cache; the loader has already warned about this store if it misbehaved
        pending.clear()


class _Miss:
    __slots__ = ()


_MISS = _Miss()
