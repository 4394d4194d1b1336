"""CachedDataset: a map-style dataset whose samples are computed once per job (or once per node, with LMDB).

Wrap the deterministic part of a pipeline (decoding, resizing, tokenizing) and keep random augmentation outside,
for example in ``collate_fn`` or in a wrapper dataset that calls ``cached[i]``. The first epoch computes and stores
each sample; later epochs, DataLoader workers and local ranks read it back. Store faults never change a value
(see :mod:`bagua.torch_api.contrib.cache_loader`).

Example:
    >>> import tempfile, torch
    >>> data = [torch.full((2,), float(i)) for i in range(4)]
    >>> cached = CachedDataset(data, dataset_name="toy", path=tempfile.mkdtemp())
    >>> loader = torch.utils.data.DataLoader(cached, batch_size=2)
    >>> [batch.sum().item() for batch in loader]
    [2.0, 10.0]
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from torch.utils.data import Dataset

from bagua.torch_api.contrib.cache_loader import CacheLoader
from bagua.torch_api.contrib.utils.fingerprint import dataset_fingerprint
from bagua.torch_api.contrib.utils.store import Store

__all__ = ["CachedDataset"]


class CachedDataset(Dataset):
    """Serve ``dataset[i]`` through a :class:`~bagua.torch_api.contrib.CacheLoader`.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``); its samples must be tensors, numpy arrays,
            plain Python values, or lists/tuples/dicts of these.
        backend: ``"lmdb"`` (default), ``"redis"`` or a :class:`~bagua.torch_api.contrib.utils.store.Store`.
        dataset_name: the cache namespace (and, for LMDB, the database's directory name).
        writer_buffer_size: new samples buffered before one batched write, when samples are read one by one
            (a ``DataLoader`` with ``batch_size`` reads and writes whole batches instead).
        version: names the data; with the dataset's class and transforms it makes the fingerprint that every key
            carries (:mod:`~bagua.torch_api.contrib.utils.fingerprint`), so a changed dataset or another job's
            dataset is a cache miss, never a wrong sample. ``None`` derives it from the dataset's length and
            plain attributes. Change it to invalidate the cache (e.g. when files change under the same path).
        **kwargs: backend options, as for :class:`~bagua.torch_api.contrib.CacheLoader`.

    Example:
        See the module docstring. A ``DataLoader`` with ``batch_size`` fetches each batch through
        ``__getitems__``: one batched read, and one batched write of the misses.
    """

    def __init__(
        self,
        dataset: Any,
        backend: Union[str, Store] = "lmdb",
        dataset_name: str = "",
        writer_buffer_size: int = 20,
        version: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.dataset = dataset
        self.fingerprint = dataset_fingerprint(dataset, version)
        self.cache_loader = CacheLoader(
            backend=backend, dataset_name=dataset_name, writer_buffer_size=writer_buffer_size,
            fingerprint=self.fingerprint, **kwargs
        )

    def _load(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitem__(self, index: Any) -> Any:
        return self.cache_loader.get(index, self._load)

    def __getitems__(self, indices: Sequence[Any]) -> list:
        """Return the samples of ``indices`` (what ``DataLoader`` calls for a batch)."""
        return self.cache_loader.get_many(list(indices), self._load)

    def __len__(self) -> int:
        return len(self.dataset)
