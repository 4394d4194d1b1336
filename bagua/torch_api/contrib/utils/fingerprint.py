"""Fingerprint what fills a dataset cache, so that a cache never serves samples of another dataset.

Cache keys are ``"{dataset_name}_{fingerprint}_{index}"``. The fingerprint is a hash of

- the dataset's class (module and qualified name);
- its version: the ``version=`` string the user gives, else one derived from the dataset's length and its plain
  attributes (numbers, strings and paths such as ``root``, ``train``, ``split``; sequences of those such as a
  file list or ``Subset.indices``; arrays and tensors up to 64 MiB by content), and the same for a wrapped
  dataset (``dataset.dataset``, as in ``Subset``); for an in-memory ``list`` or ``tuple`` of samples, their
  content;
- its transforms (``transform``, ``target_transform``, ``transforms``): functions by module, name, bytecode,
  constants, defaults and closure; objects by their ``repr`` (torchvision's names every parameter) or, without
  one, by their attributes.

Two jobs, two datasets, or a changed dataset therefore use different keys even under the same ``dataset_name``
in the same directory: a changed fingerprint is a cache miss, and the sample is recomputed. The fingerprint does
not read the data: when files change behind an unchanged path, pass a new ``version=``.

Example:
    >>> a = dataset_fingerprint([1, 2, 3])
    >>> a == dataset_fingerprint([1, 2, 3]), a == dataset_fingerprint([1, 2, 3], version="v2")
    (True, False)
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import types
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["Fingerprint", "dataset_fingerprint", "describe"]

#: Arrays and tensors up to this many bytes are hashed by content; larger ones by shape and dtype only.
MAX_HASHED_BYTES = 64 * 1024**2
_MAX_DEPTH = 4
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


@dataclass(frozen=True)
class Fingerprint:
    """A cache fingerprint: ``digest`` goes into every key, ``description`` says what was hashed."""

    digest: str
    description: str

    @classmethod
    def of(cls, text: str) -> "Fingerprint":
        """The fingerprint of a user-given string (e.g. a ``CacheLoader``'s ``fingerprint=``)."""
        return cls(hashlib.blake2b(text.encode(), digest_size=8).hexdigest(), text)


def _hash(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def _describe_array(kind: str, shape: tuple, dtype: Any, nbytes: int, raw: Any) -> str:
    if nbytes > MAX_HASHED_BYTES:
        return f"{kind}{list(shape)}:{dtype}"
    return f"{kind}{list(shape)}:{dtype}:{_hash(raw())}"


def _describe_code(code: types.CodeType) -> str:
    consts = [_describe_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return _hash(code.co_code + repr((consts, code.co_names)).encode())


def describe(obj: Any, depth: int = 0) -> str:
    """A stable text for ``obj``: equal for equal transforms across runs (no memory addresses).

    Args:
        obj: a transform, a value, or any object.
        depth: nesting level reached (descriptions stop at a few levels).

    Returns:
        The text that is hashed.

    Example:
        >>> describe(lambda x: x + 1) == describe(lambda x: x + 1)
        True
    """
    if isinstance(obj, _SCALARS):
        return repr(obj) if not isinstance(obj, bytes) or len(obj) <= 64 else f"bytes:{_hash(obj)}"
    if isinstance(obj, os.PathLike):
        return repr(os.fspath(obj))
    if depth >= _MAX_DEPTH:
        return type(obj).__qualname__
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().cpu().contiguous()
        return _describe_array("tensor", tuple(obj.shape), obj.dtype, flat.numel() * flat.element_size(),
                               lambda: flat.view(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            return f"ndarray{list(obj.shape)}:object"
        return _describe_array("ndarray", obj.shape, obj.dtype, obj.nbytes, lambda: np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, (list, tuple, range, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        text = "[" + ",".join(describe(item, depth + 1) for item in items) + "]"
        return f"{type(obj).__name__}:{_hash(text.encode())}" if len(text) > 512 else text
    if isinstance(obj, dict):
        return "{" + ",".join(f"{describe(k, depth + 1)}:{describe(v, depth + 1)}"
                              for k, v in sorted(obj.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(obj, functools.partial):
        return f"partial({describe(obj.func, depth + 1)},{describe(obj.args, depth + 1)},{describe(obj.keywords, depth + 1)})"
    if isinstance(obj, types.MethodType):
        return f"{describe(obj.__self__, depth + 1)}.{obj.__func__.__name__}"
    if isinstance(obj, types.FunctionType):
        closure = [c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not obj]
        return (f"{obj.__module__}.{obj.__qualname__}(code={_describe_code(obj.__code__)},"
                f"defaults={describe(obj.__defaults__, depth + 1)},closure={describe(closure, depth + 1)})")
    if isinstance(obj, (type, types.BuiltinFunctionType, types.ModuleType)):
        return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}"
    cls = type(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__repr__ is not object.__repr__:
        return f"{name}:{_ADDRESS.sub('', repr(obj))}"
    return f"{name}{describe(getattr(obj, '__dict__', {}), depth + 1)}"


def _state(dataset: Any, depth: int) -> list[str]:
    """The derived version: the length and the plain attributes, and a wrapped dataset's, recursively."""
    parts = []
    if hasattr(dataset, "__len__"):
        parts.append(f"len={len(dataset)}")
    if isinstance(dataset, (list, tuple)):
        # an in-memory sequence: its samples are already computed, so hash them (arrays and tensors by content)
        return parts + [f"items={describe(list(dataset), 1)}"]
    for key, value in sorted(getattr(dataset, "__dict__", {}).items()):
        if key.startswith("_") or key in ("transform", "target_transform", "transforms"):
            continue
        if key == "dataset" and depth < _MAX_DEPTH and hasattr(value, "__getitem__"):
            parts.append(f"dataset=({'; '.join(_parts(value, None, depth + 1))})")
        elif isinstance(value, (*_SCALARS, os.PathLike, list, tuple, range, np.ndarray, torch.Tensor)):
            parts.append(f"{key}={describe(value, 1)}")
    return parts


def _parts(dataset: Any, version: Optional[str], depth: int) -> list[str]:
    cls = type(dataset)
    parts = [f"class={cls.__module__}.{cls.__qualname__}"]
    parts += [f"version={version!r}"] if version is not None else _state(dataset, depth)
    for name in ("transform", "target_transform", "transforms"):
        if getattr(dataset, name, None) is not None:
            parts.append(f"{name}={describe(getattr(dataset, name))}")
    return parts


def dataset_fingerprint(dataset: Any, version: Optional[str] = None) -> Fingerprint:
    """Fingerprint ``dataset``: its class, ``version`` (or the derived one) and its transforms.

    Args:
        dataset: a map-style dataset.
        version: names the data (e.g. ``"imagenet-2012-v3"`` or a hash of a manifest); replaces the version
            derived from the dataset's length and attributes. Change it to invalidate the cache.

    Returns:
        The :class:`Fingerprint`.

    Example:
        See the module docstring.
    """
    description = "; ".join(_parts(dataset, version, 0))
    return Fingerprint(_hash(description.encode()), description)
