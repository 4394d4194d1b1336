"""Key-value stores and the value codec behind :class:`~bagua.torch_api.contrib.CacheLoader`.

- :mod:`.serialization`: ``encode`` / ``decode`` for tensors, arrays and plain containers, without pickle.
- :mod:`.store`: the :class:`~.store.Store` interface and :class:`~.store.ClusterStore` (rendezvous hashing).
- :mod:`.lmdb_store`: :class:`~.lmdb_store.LmdbStore`, the embedded node-local default (needs ``lmdb``).
- :mod:`.redis_store`: :class:`~.redis_store.RedisStore`, spawned or external ``redis-server`` (needs ``redis``);
  :mod:`.redis_server` starts the ``redis-server`` processes (re-exported by :mod:`.redis_store`).

The backend modules are not imported here, so that using one never requires the other's package.
"""

from __future__ import annotations

__all__: list[str] = []
