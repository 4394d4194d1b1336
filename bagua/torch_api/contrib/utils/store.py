"""The key-value store interface behind the dataset cache, and a sharded store over several of them.

A :class:`Store` maps ``str`` keys to ``bytes`` values. Backends translate their own failures into
:class:`StoreError` (unreachable, refused) or :class:`StoreFullError` (out of space), so that the cache can fall
back to the dataset on exactly those and still let programming errors surface.

:class:`ClusterStore` spreads keys over several stores with rendezvous (highest-random-weight) hashing: every
key goes to the store whose ``hash(store name, key)`` is largest. Adding an (n+1)-th store moves only the keys
that now score highest there, about 1/(n+1) of them, and every moved key moves *to* the new store; plain
``hash % n`` (the original Bagua) moves about n/(n+1) of them. Reference: Thaler & Ravishankar, "Using
name-based mappings to increase hit rates", IEEE/ACM ToN 1998.

Example:
    >>> class DictStore(Store):
    ...     def __init__(self):
    ...         self.data = {}
    ...     def mset(self, mapping):
    ...         self.data.update(mapping)
    ...     def mget(self, keys):
    ...         return [self.data.get(k) for k in keys]
    ...     def num_keys(self):
    ...         return len(self.data)
    ...     def clear(self):
    ...         self.data.clear()
    >>> cluster = ClusterStore([DictStore(), DictStore()], names=["a", "b"])
    >>> cluster.mset({"x": b"1", "y": b"2"})
    >>> cluster.mget(["y", "x", "z"])
    [b'2', b'1', None]
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Optional, Sequence

__all__ = ["Store", "ClusterStore", "StoreError", "StoreFullError", "rendezvous_owner"]


class StoreError(RuntimeError):
    """The store could not serve the request (down, unreachable, refused); the caller may fall back."""


class StoreFullError(StoreError):
    """The store is out of space and refused a write; reads may still work."""


class Store:
    """A ``str -> bytes`` store. Subclasses implement :meth:`mset`, :meth:`mget`, :meth:`num_keys`, :meth:`clear`.

    Every method may raise :class:`StoreError`; ``set`` / ``get`` / ``status`` / ``shutdown`` have defaults
    built on the others.
    """

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwriting)."""
        self.mset({key: value})

    def get(self, key: str) -> Optional[bytes]:
        """Return the value under ``key``, or ``None`` when it is absent."""
        return self.mget([key])[0]

    def mset(self, mapping: Mapping[str, bytes]) -> None:
        """Store every item of ``mapping`` in as few round trips as the backend allows."""
        raise NotImplementedError

    def mget(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        """Return the values of ``keys`` in order, ``None`` for absent ones."""
        raise NotImplementedError

    def num_keys(self) -> int:
        """Number of keys stored (all datasets sharing this store included)."""
        raise NotImplementedError

    def clear(self) -> None:
        """Remove every key."""
        raise NotImplementedError

    def status(self) -> bool:
        """Whether the store answers right now."""
        try:
            self.num_keys()
        except StoreError:
            return False
        return True

    def shutdown(self) -> None:
        """Release connections and any server this object started; the default does nothing."""


def _score(name: bytes, key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, key=name[:64]).digest(), "little")


def rendezvous_owner(key: str, names: Sequence[str]) -> int:
    """Return the index in ``names`` of the store that owns ``key`` under rendezvous hashing.

    Args:
        key: the cache key.
        names: one stable name per store (e.g. ``"host:port"``); an owner depends only on the key and the names.

    Returns:
        An index into ``names``.

    Example:
        >>> rendezvous_owner("sample_3", ["a:1", "b:2"]) in (0, 1)
        True
    """
    raw = key.encode()
    return max(range(len(names)), key=lambda i: _score(names[i].encode(), raw))


class ClusterStore(Store):
    """Shard keys over ``stores`` by rendezvous hashing; batched calls make one request per store.

    Args:
        stores: the shards.
        names: one stable, distinct name per store; a key's owner depends only on these names, so give the same
            server the same name in every process. Defaults to ``"0"``, ``"1"``, ...

    Example:
        See the module docstring.
    """

    def __init__(self, stores: Sequence[Store], names: Optional[Sequence[str]] = None) -> None:
        if not stores:
            raise ValueError("ClusterStore needs at least one store")
        names = [str(i) for i in range(len(stores))] if names is None else [str(n) for n in names]
        if len(names) != len(stores):
            raise ValueError(f"got {len(names)} names for {len(stores)} stores; give one name per store")
        if len(set(names)) != len(names):
            raise ValueError(f"store names must be distinct, got {names}")
        self.stores = list(stores)
        self.names = names
        self._encoded = [n.encode() for n in names]

    def owner(self, key: str) -> int:
        """Index of the store that holds ``key``."""
        if len(self.stores) == 1:
            return 0
        raw = key.encode()
        return max(range(len(self._encoded)), key=lambda i: _score(self._encoded[i], raw))

    def mset(self, mapping: Mapping[str, bytes]) -> None:
        groups: dict[int, dict[str, bytes]] = {}
        for key, value in mapping.items():
            groups.setdefault(self.owner(key), {})[key] = value
        for index, group in groups.items():
            self.stores[index].mset(group)

    def mget(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        groups: dict[int, list[int]] = {}
        for position, key in enumerate(keys):
            groups.setdefault(self.owner(key), []).append(position)
        out: list[Optional[bytes]] = [None] * len(keys)
        for index, positions in groups.items():
            values = self.stores[index].mget([keys[p] for p in positions])
            for position, value in zip(positions, values):
                out[position] = value
        return out

    def num_keys(self) -> int:
        return sum(store.num_keys() for store in self.stores)

    def clear(self) -> None:
        for store in self.stores:
            store.clear()

    def status(self) -> bool:
        return all(store.status() for store in self.stores)

    def shutdown(self) -> None:
        for store in self.stores:
            store.shutdown()
