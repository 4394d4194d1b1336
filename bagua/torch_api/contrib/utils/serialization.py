"""Encode cached samples as self-describing bytes, and decode them without ever running code.

A cache that every process on the network can write must not be able to make a reader execute code, so values are
never pickled. An entry is::

    b"BGC1" | crc32 (u32) | header length (u32) | payload length (u64) | header (JSON, UTF-8) | payload (raw bytes)

all little-endian. The CRC covers everything after itself. The header is a tree of small JSON lists, one per value:

==========================  =================================================================
``["n"]``                   None
``["b", true]``             bool
``["i", 12]``               int (any size)
``["f", "0x1.8p+1"]``       float, as ``float.hex`` so that every value (nan, -0.0) round-trips
``["s", "text"]``           str
``["y", off, n]``           bytes: ``payload[off:off + n]``
``["l", [...]]``            list; ``["t", [...]]`` tuple; ``["d", [[k, v], ...]]`` dict
``["T", dtype, shape, off, n]``  CPU torch tensor of a listed dtype (``bfloat16`` included)
``["a", descr, shape, off, n]``  numpy array of a non-object dtype; ``["g", ...]`` a numpy scalar
==========================  =================================================================

Decoding checks the magic, the lengths, the CRC, every offset and every ``shape x itemsize`` against its buffer;
anything that does not add up raises :class:`CorruptEntryError` and nothing is returned. Decoded tensors and
arrays own fresh, writable memory. Tensors come back on the CPU without ``requires_grad``; tuples subclasses such
as ``torch.Size`` or named tuples come back as plain tuples.

Example:
    >>> import torch
    >>> value = {"image": torch.ones(2, 3, dtype=torch.bfloat16), "label": 7}
    >>> out = decode(encode(value))
    >>> out["label"], out["image"].dtype
    (7, torch.bfloat16)
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from typing import Any, Union

import numpy as np
import torch

__all__ = ["encode", "decode", "CorruptEntryError", "MAGIC", "MAX_DEPTH"]

MAGIC = b"BGC1"
#: Deepest container nesting accepted both ways; deeper values are almost surely a cycle or a crafted entry.
MAX_DEPTH = 64

_PREFIX = struct.Struct("<4sIIQ")  # magic, crc32, header length, payload length

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_TORCH_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}

# numpy descriptors we rebuild: byte order, kind, item size, optional datetime unit. Object ("O") and structured
# ("V") dtypes are refused: the first holds Python objects, the second can nest them.
_NUMPY_KINDS = "biufcSUmM"
_NUMPY_DESCR = re.compile(r"^[<>|=][biufcSUmM]\d{1,6}(\[\d*[a-zA-Z]{1,2}\])?$")

Buffer = Union[bytes, bytearray, memoryview]


class CorruptEntryError(ValueError):
    """The bytes are not a well-formed entry (bad magic, length, checksum or header); treat the entry as a miss."""


# ---------------------------------------------------------------------------------------------------- encoding


def encode(value: Any) -> bytes:
    """Serialize ``value`` into one self-describing ``bytes`` object.

    Args:
        value: a torch tensor (strided, any listed dtype, any device: it is copied to the CPU), a numpy array or
            scalar of a non-object dtype, ``None``/``bool``/``int``/``float``/``str``/``bytes``, or a
            ``list``/``tuple``/``dict`` of these, nested up to :data:`MAX_DEPTH` levels.

    Returns:
        The entry, ready to store.

    Raises:
        TypeError: a value of an unsupported type (the message names it and lists the supported ones).
        ValueError: nesting deeper than :data:`MAX_DEPTH` (or a reference cycle).

    Example:
        >>> len(encode([1, 2.5, "three"])) > 0
        True
    """
    buffers: list[memoryview] = []
    offset = [0]

    def add_buffer(raw: memoryview) -> list[int]:
        start = offset[0]
        buffers.append(raw)
        offset[0] += raw.nbytes
        return [start, raw.nbytes]

    header = json.dumps(_encode_node(value, add_buffer, 0), separators=(",", ":"), allow_nan=False).encode()
    payload_len = offset[0]
    fields = struct.pack("<IQ", len(header), payload_len)
    crc = zlib.crc32(header, zlib.crc32(fields))
    for raw in buffers:
        crc = zlib.crc32(raw, crc)
    return b"".join([MAGIC, struct.pack("<I", crc), fields, header, *buffers])


def _encode_node(value: Any, add_buffer, depth: int) -> list:
    if depth > MAX_DEPTH:
        raise ValueError(f"value nests deeper than {MAX_DEPTH} containers (a reference cycle?); flatten it")
    if value is None:
        return ["n"]
    if isinstance(value, bool):
        return ["b", value]
    if isinstance(value, int):
        return ["i", int(value)]
    if isinstance(value, float):
        return ["f", float(value).hex()]
    if isinstance(value, str):
        return ["s", value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ["y", *add_buffer(memoryview(value).cast("B"))]
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, add_buffer)
    if isinstance(value, (np.ndarray, np.generic)):
        return _encode_array(value, add_buffer)
    if isinstance(value, list):
        return ["l", [_encode_node(v, add_buffer, depth + 1) for v in value]]
    if isinstance(value, tuple):
        return ["t", [_encode_node(v, add_buffer, depth + 1) for v in value]]
    if isinstance(value, dict):
        return ["d", [[_encode_node(k, add_buffer, depth + 1), _encode_node(v, add_buffer, depth + 1)]
                      for k, v in value.items()]]
    raise TypeError(
        f"cannot cache a value of type {type(value).__name__}; supported: torch tensors, numpy arrays and scalars, "
        "None, bool, int, float, str, bytes and list/tuple/dict of these (convert e.g. PIL images to arrays)"
    )


def _encode_tensor(tensor: torch.Tensor, add_buffer) -> list:
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"cannot cache a {tensor.layout} / quantized tensor; convert it with .to_dense() first")
    name = _TORCH_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"cannot cache a tensor of dtype {tensor.dtype}; supported: {sorted(_TORCH_DTYPES)}")
    flat = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)
    raw = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
    return ["T", name, list(tensor.shape), *add_buffer(raw)]


def _encode_array(value: np.ndarray | np.generic, add_buffer) -> list:
    array = np.asarray(value)
    if not array.flags.c_contiguous:  # np.ascontiguousarray would turn a 0-d array into a 1-d one
        array = array.copy(order="C")
    if array.dtype.hasobject or array.dtype.kind not in _NUMPY_KINDS:
        raise TypeError(f"cannot cache a numpy array of dtype {array.dtype}; object and structured dtypes are refused")
    tag = "g" if isinstance(value, np.generic) else "a"
    raw = memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")
    return [tag, array.dtype.str, list(array.shape), *add_buffer(raw)]


# ---------------------------------------------------------------------------------------------------- decoding


def decode(data: Buffer) -> Any:
    """Rebuild the value that :func:`encode` serialized, after checking that the entry is intact.

    Args:
        data: the stored bytes.

    Returns:
        The value; tensors and arrays are fresh CPU copies.

    Raises:
        CorruptEntryError: the bytes are truncated, altered, or were not written by :func:`encode`.

    Example:
        >>> decode(encode((1, None)))
        (1, None)
    """
    view = memoryview(data).cast("B")
    if view.nbytes < _PREFIX.size:
        raise CorruptEntryError(f"entry of {view.nbytes} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, crc, header_len, payload_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntryError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}); not a Bagua cache entry")
    if _PREFIX.size + header_len + payload_len != view.nbytes:
        raise CorruptEntryError(
            f"entry is {view.nbytes} bytes but its prefix announces {_PREFIX.size + header_len + payload_len}"
        )
    if zlib.crc32(view[8:]) != crc:
        raise CorruptEntryError("checksum mismatch; the entry was altered or truncated")
    header_end = _PREFIX.size + header_len
    payload = view[header_end:]
    try:
        tree = json.loads(bytes(view[_PREFIX.size:header_end]).decode("utf-8"))
        return _decode_node(tree, payload, 0)
    except CorruptEntryError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, OverflowError) as error:
        raise CorruptEntryError(f"malformed header: {error}") from None


def _decode_node(node: Any, payload: memoryview, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CorruptEntryError(f"header nests deeper than {MAX_DEPTH} containers")
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise CorruptEntryError(f"header node {node!r:.60} is not a tagged list")
    tag, args = node[0], node[1:]
    if tag == "n" and not args:
        return None
    if tag == "b" and len(args) == 1 and isinstance(args[0], bool):
        return args[0]
    if tag == "i" and len(args) == 1 and isinstance(args[0], int) and not isinstance(args[0], bool):
        return args[0]
    if tag == "f" and len(args) == 1 and isinstance(args[0], str):
        return float.fromhex(args[0])
    if tag == "s" and len(args) == 1 and isinstance(args[0], str):
        return args[0]
    if tag == "y" and len(args) == 2:
        return bytes(_slice(payload, args[0], args[1]))
    if tag in ("l", "t") and len(args) == 1 and isinstance(args[0], list):
        items = [_decode_node(v, payload, depth + 1) for v in args[0]]
        return items if tag == "l" else tuple(items)
    if tag == "d" and len(args) == 1 and isinstance(args[0], list):
        out = {}
        for pair in args[0]:
            if not isinstance(pair, list) or len(pair) != 2:
                raise CorruptEntryError("dict item is not a [key, value] pair")
            out[_decode_node(pair[0], payload, depth + 1)] = _decode_node(pair[1], payload, depth + 1)
        return out
    if tag == "T" and len(args) == 4:
        return _decode_tensor(*args, payload)
    if tag in ("a", "g") and len(args) == 4:
        array = _decode_array(*args, payload)
        return array[()] if tag == "g" else array
    raise CorruptEntryError(f"unknown or malformed header node {node!r:.60}")


def _slice(payload: memoryview, offset: Any, nbytes: Any) -> memoryview:
    valid = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, nbytes))
    if not valid or offset + nbytes > payload.nbytes:
        raise CorruptEntryError(f"buffer [{offset}, +{nbytes}) lies outside the {payload.nbytes}-byte payload")
    return payload[offset:offset + nbytes]


def _checked_shape(shape: Any, itemsize: int, nbytes: int) -> tuple[int, ...]:
    valid = isinstance(shape, list) and len(shape) <= MAX_DEPTH and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    )
    if not valid or math.prod(shape) * itemsize != nbytes:
        raise CorruptEntryError(f"shape {shape!r:.60} x {itemsize} bytes does not match its {nbytes}-byte buffer")
    return tuple(shape)


def _decode_tensor(name: Any, shape: Any, offset: Any, nbytes: Any, payload: memoryview) -> torch.Tensor:
    dtype = _TORCH_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CorruptEntryError(f"tensor dtype {name!r:.40} is not one of {sorted(_TORCH_DTYPES)}")
    raw = _slice(payload, offset, nbytes)
    dims = _checked_shape(shape, dtype.itemsize, nbytes)
    if nbytes == 0:
        return torch.empty(dims, dtype=dtype)
    # A fresh bytearray is malloc-aligned, so the tensor can take the dtype directly.
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(dims)


def _decode_array(descr: Any, shape: Any, offset: Any, nbytes: Any, payload: memoryview) -> np.ndarray:
    if not isinstance(descr, str) or not _NUMPY_DESCR.match(descr):
        raise CorruptEntryError(f"numpy dtype {descr!r:.40} is not an allowed plain dtype")
    dtype = np.dtype(descr)
    if dtype.hasobject or dtype.kind not in _NUMPY_KINDS:
        raise CorruptEntryError(f"numpy dtype {descr!r} is not an allowed plain dtype")
    raw = _slice(payload, offset, nbytes)
    dims = _checked_shape(shape, dtype.itemsize, nbytes)
    return np.frombuffer(raw, dtype=dtype).reshape(dims).copy()
