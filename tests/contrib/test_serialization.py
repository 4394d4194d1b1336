"""The cache codec: exact round trips for every supported value, and refusal of everything else."""

from __future__ import annotations

import math
import pickle
import struct
import zlib

import numpy as np
import pytest
import torch

from bagua.torch_api.contrib.utils.serialization import MAGIC, MAX_DEPTH, CorruptEntryError, decode, encode

TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 2), (2, 3, 4)])
def test_tensor_round_trip_is_bit_exact(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    source = (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
    out = decode(encode(source))
    assert _same_bits(out, source)
    out.add_(1) if dtype != torch.bool else out.logical_not_()  # decoded memory is fresh and writable
    assert _same_bits(decode(encode(source)), source)


def test_tensor_views_and_flags_are_materialized():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for view in (base.t(), base[:, ::2], base[1], torch.randn(3, dtype=torch.complex64).conj(),
                 torch.nn.Parameter(torch.ones(2))):
        out = decode(encode(view))
        torch.testing.assert_close(out, view.detach().resolve_conj(), rtol=0, atol=0)
        assert out.is_contiguous() and not out.requires_grad


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.arange(12, dtype=">i4").reshape(2, 6),  # big-endian keeps its byte order
    np.array([True, False]),
    np.array(["ab", "cde"]),
    np.array([b"x", b"yz"]),
    np.array(["2024-01-02"], dtype="datetime64[ns]"),
    np.array(3.5),
    np.zeros((0, 3), dtype=np.complex128),
    np.arange(10, dtype=np.int16)[::3],
], ids=lambda a: f"{a.dtype.str}{a.shape}")
def test_numpy_round_trip(array):
    out = decode(encode(array))
    assert out.dtype == array.dtype and out.shape == array.shape and out.flags.writeable
    np.testing.assert_array_equal(out, array)


def test_numpy_scalars_stay_scalars():
    for scalar in (np.float32(1.5), np.int64(-3), np.bool_(True)):
        out = decode(encode(scalar))
        assert type(out) is type(scalar) and out == scalar


def test_plain_values_and_containers_round_trip():
    value = {
        "none": None, "flags": [True, False], "big": 2**100, "neg": -7,
        "floats": [0.1, -0.0, math.inf, -math.inf, 1e-310], "text": "héllo\0", "raw": b"\x00\xff",
        (1, "k"): ("tuple", [torch.ones(2, 2, dtype=torch.bfloat16), np.ones(3)]),
        7: {"nested": [[[]]]},
    }
    out = decode(encode(value))
    assert out.keys() == value.keys()
    assert out["floats"][:2] == [0.1, -0.0] and math.copysign(1, out["floats"][1]) == -1
    assert out["floats"][2:] == value["floats"][2:] and out["big"] == 2**100 and out["text"] == "héllo\0"
    assert out[(1, "k")][0] == "tuple" and isinstance(out[(1, "k")], tuple)
    assert _same_bits(out[(1, "k")][1][0], value[(1, "k")][1][0])
    assert out[7] == {"nested": [[[]]]} and out["raw"] == b"\x00\xff" and out["none"] is None
    assert math.isnan(decode(encode(math.nan)))


@pytest.mark.parametrize("value", [object(), {1, 2}, np.array([object()]),
                                   np.zeros(2, dtype=[("a", "i4")]), torch.ones(2).to_sparse()],
                         ids=["object", "set", "object-array", "structured-array", "sparse"])
def test_unsupported_values_are_refused(value):
    with pytest.raises(TypeError, match="cannot cache"):
        encode(value)


def test_deep_nesting_is_refused():
    value: list = []
    for _ in range(MAX_DEPTH + 2):
        value = [value]
    with pytest.raises(ValueError, match="deeper"):
        encode(value)


def _forge(header: bytes, payload: bytes = b"") -> bytes:
    """Build an entry with a valid prefix and checksum around any header: only the content checks remain."""
    fields = struct.pack("<IQ", len(header), len(payload))
    crc = zlib.crc32(payload, zlib.crc32(header, zlib.crc32(fields)))
    return MAGIC + struct.pack("<I", crc) + fields + header + payload


def test_every_single_byte_flip_is_detected():
    entry = bytearray(encode({"x": torch.arange(6, dtype=torch.int16), "y": "label"}))
    for position in range(len(entry)):
        corrupt = bytearray(entry)
        corrupt[position] ^= 0x41
        with pytest.raises(CorruptEntryError):
            decode(bytes(corrupt))


@pytest.mark.parametrize("entry", [
    b"",
    b"BGC1",
    pickle.dumps({"a": 1}),
    encode([1, 2])[:-1],
    encode([1, 2]) + b"\0",
    _forge(b"not json"),
    _forge(b'["T","float32",[4],0,16]', b"\0" * 8),  # buffer shorter than the shape needs
    _forge(b'["T","float32",[3],0,12]', b"\0" * 8),  # buffer outside the payload
    _forge(b'["T","float32",[-1],0,0]'),
    _forge(b'["T","torch.storage",[1],0,4]', b"\0" * 4),
    _forge(b'["a","|O8",[1],0,8]', b"\0" * 8),  # object arrays would hold pointers
    _forge(b'["a","[(\'a\',\'O\')]",[1],0,8]', b"\0" * 8),
    _forge(b'["pickle","gASVAAAAAAAAAAAu"]'),
    _forge(b'["d",[[["l",[]],["n"]]]]'),  # unhashable key
    _forge(b'["i",1.5]'),
    _forge(b"[" * 100_000 + b"]" * 100_000),
], ids=lambda e: repr(e[:24]))
def test_malformed_entries_raise_corrupt_entry_error(entry):
    with pytest.raises(CorruptEntryError):
        decode(entry)
