"""Block-wise low-bit codecs (``bf16``, ``uint8``, ``uint4``, ``nf2``, ``sign1``) as pure tensor functions.

A 1-D float32 tensor of ``n`` elements splits into blocks of ``block_size`` consecutive elements (the last one may
be short). ``uint8`` and ``uint4`` quantize every block on its own range with ``L = 255`` or ``L = 15`` levels; in
float32, with every division a true (correctly rounded) division::

    r = max - min;  s = L / r  (s = 0 when that is not finite: r == 0 or r < L / FLT_MAX)
    encode: q = round_half_even((x - min) * s)          (0 <= q <= L without a clamp: x - min <= r)
    decode: x' = min + q * (r / L)

so ``q = 0`` decodes to ``min`` exactly, and a block whose ``s`` is 0 (a constant block, or a range below
``L / FLT_MAX``: 4e-38 for uint4, 7e-37 for uint8) decodes to ``min`` everywhere. Blocks with ``max(|min|,
|max|) >= 2**126``, where ``r`` or ``min + q * r / L`` could overflow, use the same formulas on the halved values
(exact scalings there) and clamp the result: ``x' = clamp(2 * (min/2 + q * (r/2 / L)), min, max)``; so every
finite block decodes to finite values. A block holding a NaN or an Inf gets codes 0 and decodes to NaN
everywhere, which callers can detect.

Bound (:func:`error_bound`), per element, ``M = max(|min|, |max|)`` of its block, ``u = 2**-24``::

    |x - x'| <= r / (2 L) + 32 u M      (half a step, plus the float32 rounding of the encode and decode)
    |x - x'| <= r                       (blocks whose s is 0)

The rounding term is at most about ``22 u M`` (``r <= 2 M``; encode 4 roundings, decode 3, and a subnormal
``r / L`` when ``r`` is tiny); ``32 u M = 2**-19 M`` states it with margin. ``bf16``: the wire is the
bfloat16 of ``x`` (round to nearest even, torch's cast), ``|x - x'| <= 2**-8 |x| + 2**-134``, and ``|x|`` at or
above ``(2 - 2**-8) * 2**127`` becomes Inf.

Wire layout (``uint8`` / ``uint4``): all the headers first, block after block the float32 pair ``(min, max)``
(8 bytes; a zero as +0), then every block's codes in block order. ``uint8`` spends one byte per element. ``uint4`` packs two
codes per byte, and to keep every step a contiguous operation it pairs the two halves of a block: byte ``i`` of
a block of ``m`` elements holds the code of element ``i`` in its low nibble and that of element ``i + ceil(m/2)``
in its high nibble (0 past the end). At the default block of 4096, ``uint4`` spends ``(8 + 2048) / 2048``
bytes per two elements: 0.39 % above ``n / 2``.

``nf2`` (:mod:`~bagua.torch_api.codecs.normal2`): 2-bit codes at a normal distribution's Lloyd-Max levels about
each block's mean and RMS, the float32 header ``(mean, rms)``, four codes to a byte by quarters of the block (2.25
bits per value at a block of 256). ``sign1`` (:mod:`~bagua.torch_api.codecs.sign1`): one bit per value, its side of
the block's mean, scaled by the block's mean absolute deviation; header ``(mean, deviation)``, eight codes to a
byte (1.25 bits per value at 256). Both run whole-tensor operations on every device; the reductions run in float64,
so devices agree on the bytes except in a rounding tie of the header.

Deterministic: the codes depend only on these float32 operations (no fused multiply-add, no reciprocal of a
scalar divisor), so every rank and device writes the same bytes for the same input.

Speed: on CPU the functions stream the blocks through a scratch piece of :data:`PIECE` elements (1 MiB of
float32, about one core's L2): the encoder reads each piece once from memory for its min/max and quantizes it
while it is in cache; ``round`` and the float -> integer cast are one addition of ``2**23`` (the float32 bits
of ``2**23 + q`` end in the byte ``q``); the uint4 decoder unpacks with one byte mask (:func:`_dequantize_pairs`).
CUDA tensors take the Triton kernels of :mod:`~bagua.torch_api.codecs.triton_kernels` (one pass over memory,
the same bytes and values) where Triton is installed; other devices run whole-tensor operations. One thread, against MinMaxUInt8 (``compression.py``): see
``benchmarks/codec.py``.

Example:
    >>> x = torch.randn(10_000)
    >>> wire = encode(x, "uint4")
    >>> wire.numel() == wire_numel(10_000, "uint4")
    True
    >>> bool(((x - decode(wire, 10_000, "uint4")).abs() <= error_bound(x, "uint4")).all())
    True
"""

from __future__ import annotations

from typing import Optional

import torch
from bagua.torch_api.codecs import normal2, sign1, sparse, triton_kernels
from bagua.torch_api.codecs._constants import constant
from bagua.torch_api.codecs._block_kernels import (PIECE, _decode_one, _dequantize, _dequantize_pairs, _huge,
                                                   _pieces, _quantize, _Scratch, _scale, _step)

__all__ = ["CODECS", "DEFAULT_BLOCK", "PIECE", "wire_numel", "encode", "decode", "error_bound"]

CODECS = ("bf16", "uint8", "uint4", "nf2", "sign1")
#: codecs coded row by row about each block's mean (a ``(mean, scale)`` header): their modules
_ROW_CODECS = {"nf2": normal2, "sign1": sign1}
#: codecs that keep some values only (:mod:`~bagua.torch_api.codecs.sparse`), exchanged by all-gather
SPARSE = ("topk",)
#: Elements per block. The uint4 headers cost 8 bytes per block, 0.39 % of the codes at 4096 (2048: 0.78 %; 1024
#: is above the 1 % goal). Speed is flat from 1024 to 65536 (within a few %, ``benchmarks/codec.py --block-sizes``),
#: and larger blocks have wider ranges, so coarser steps: 4096 is the smallest block with headers well under 1 %.
DEFAULT_BLOCK = 4096

HEADER_BYTES = 8
_LEVELS = {"uint8": 255, "uint4": 15}
_HUGE = 2.0**126
_BF16_OVERFLOW = (2 - 2**-8) * 2.0**127  # the float32 values from here round to Inf in bfloat16


def _check(codec: str, block_size: int) -> None:
    if codec not in CODECS and codec not in SPARSE:
        raise ValueError(f"unknown codec {codec!r}; available: {', '.join(CODECS + SPARSE)}")
    if block_size < 2 or block_size % 2:
        raise ValueError(f"block_size must be a positive even number (e.g. {DEFAULT_BLOCK}), got {block_size}")


def _code_bytes(length: int, codec: str) -> int:
    """Bytes of codes for a block of ``length`` elements."""
    if codec in _ROW_CODECS:
        return _ROW_CODECS[codec].code_bytes(length)
    return length if codec == "uint8" else (length + 1) // 2


def wire_numel(numel: int, codec: str, block_size: int = DEFAULT_BLOCK) -> int:
    """Return the bytes on the wire for ``numel`` float32 values.

    ``bf16``: ``2 n``; ``uint8``: ``8 b + n``; ``uint4`` / ``nf2`` / ``sign1``: ``8 b`` plus ``ceil(m / 2)`` /
    ``ceil(m / 4)`` / ``ceil(m / 8)`` per block of ``m`` elements, where ``b = ceil(n / block_size)`` is the number
    of blocks.

    Example:
        >>> wire_numel(10_000, "bf16"), wire_numel(10_000, "uint8"), wire_numel(10_000, "uint4")
        (20000, 10024, 5024)
        >>> wire_numel(10_000, "nf2", 256), wire_numel(10_000, "sign1", 256)
        (2820, 1570)
    """
    _check(codec, block_size)
    if codec == "bf16":
        return 2 * numel
    if codec == "topk":
        return sparse.wire_numel(numel, block_size)
    full, tail = divmod(numel, block_size)
    blocks = full + (tail > 0)
    return HEADER_BYTES * blocks + full * _code_bytes(block_size, codec) + _code_bytes(tail, codec)


def _layout(numel: int, codec: str, block_size: int) -> list[tuple[int, int, int, int, int]]:
    """The runs of equal blocks: ``(first block, blocks, block length, element offset, code byte offset)``."""
    full, tail = divmod(numel, block_size)
    blocks = full + (tail > 0)
    runs = [(0, full, block_size, 0, HEADER_BYTES * blocks)] if full else []
    if tail:
        runs.append((full, 1, tail, full * block_size, HEADER_BYTES * blocks + full * _code_bytes(block_size, codec)))
    return runs


def _check_x(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"x must be a 1-D float32 tensor (use t.float().view(-1)), got {x.dtype} {tuple(x.shape)}")
    return x.contiguous()


def _check_wire(wire: torch.Tensor, nbytes: int, name: str) -> None:
    if wire.dtype != torch.uint8 or wire.dim() != 1 or wire.numel() != nbytes:
        raise ValueError(f"{name} must be a 1-D uint8 tensor of wire_numel() = {nbytes} bytes, "
                         f"got {wire.dtype} {tuple(wire.shape)}")


def _header(wire: torch.Tensor, blocks: int) -> torch.Tensor:
    """The ``(blocks, 2)`` float32 ``(min, max)`` at the start of ``wire``."""
    raw = wire[: HEADER_BYTES * blocks]
    if raw.storage_offset() % 4:
        raw = raw.clone()  # a float32 view needs 4-byte alignment
    return raw.view(torch.float32).view(blocks, 2)


def encode(x: torch.Tensor, codec: str, block_size: int = DEFAULT_BLOCK,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Encode the 1-D float32 ``x`` (any length) into a 1-D uint8 wire tensor of :func:`wire_numel` bytes.

    Args:
        x: the values; not modified.
        codec: one of :data:`CODECS`.
        block_size: elements per block (even).
        out: the wire tensor to write (``wire_numel(x.numel(), codec, block_size)`` uint8); a new one otherwise.

    Returns:
        ``out``.

    Example:
        >>> encode(torch.tensor([0.0, 0.5, 1.0]), "uint8")[8:].tolist()  # after the (min, max) header
        [0, 128, 255]
    """
    x = _check_x(x)
    n = x.numel()
    nbytes = wire_numel(n, codec, block_size)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    _check_wire(out, nbytes, "out")
    if codec == "topk":  # the sparse codec: positions and 4-bit values of each block's largest (codecs.sparse)
        return sparse.encode(x, block_size, out)
    if codec == "bf16":
        if out.storage_offset() % 2 == 0:
            out.view(torch.bfloat16).copy_(x)
        else:
            out.copy_(x.to(torch.bfloat16).view(torch.uint8))
        return out
    if codec in _ROW_CODECS:
        blocks = -(-n // block_size)
        hdr = torch.empty(blocks, 2, dtype=torch.float32, device=x.device)
        for rows, codes, piece_hdr in _row_pieces(x, out, hdr, codec, block_size):
            _ROW_CODECS[codec].encode_rows(rows, piece_hdr, codes)
        out[: HEADER_BYTES * blocks].copy_(hdr.add_(0.0).view(-1).view(torch.uint8))  # a zero as +0
        return out
    if _fused(x, out, block_size):  # CUDA: one Triton kernel, the same bytes (triton_kernels)
        return triton_kernels.block_encode(x, codec, block_size, out)
    levels = _LEVELS[codec]
    blocks = -(-n // block_size)
    hdr = torch.empty(blocks, 2, dtype=torch.float32, device=x.device)
    for first, count, m, start, c in _layout(n, codec, block_size):
        rows = x[start : start + count * m].view(count, m)
        codes = out[c : c + count * _code_bytes(m, codec)].view(count, -1)
        k, scratch = _pieces(rows, levels, floats=True)
        run = hdr[first : first + count]
        for xa, mn, mx, ca in _split(k, rows, run[:, 0:1], run[:, 1:2], codes):
            b = scratch if xa.shape[0] == scratch.k else _Scratch(xa.shape[0], m, levels, x.device)
            # amin and amax of a piece read memory once; torch.aminmax(dim=) is about 10x slower on CPU
            torch.amin(xa, dim=1, keepdim=True, out=mn)
            torch.amax(xa, dim=1, keepdim=True, out=mx)
            _quantize(xa, mn, _scale(mn, mx, levels), ca, b)
    hdr.add_(0.0)  # a zero min or max as +0: which sign a reduction keeps depends on its order (CPU, CUDA)
    out[: HEADER_BYTES * blocks].copy_(hdr.view(-1).view(torch.uint8))
    bad = ~torch.isfinite(hdr).all(dim=1)
    if bool(bad.any()):  # codes 0 for the blocks holding a NaN or Inf (they decode to NaN whatever their codes)
        for first, count, m, _, c in _layout(n, codec, block_size):
            out[c : c + count * _code_bytes(m, codec)].view(count, -1)[bad[first : first + count]] = 0
    for i in _huge(hdr).nonzero().view(-1).tolist():
        a, b = i * block_size, min((i + 1) * block_size, n)
        c = HEADER_BYTES * blocks + i * _code_bytes(block_size, codec)
        half, mn, mx = x[a:b].view(1, -1) * 0.5, hdr[i : i + 1, 0:1] * 0.5, hdr[i : i + 1, 1:2] * 0.5
        codes = out[c : c + _code_bytes(b - a, codec)].view(1, -1)
        _quantize(half, mn, _scale(mn, mx, levels), codes, _Scratch(1, b - a, levels, x.device))
    return out


def _row_pieces(values: torch.Tensor, wire: torch.Tensor, hdr: torch.Tensor, codec: str, block_size: int):
    """The row codecs' pieces of blocks: ``(rows of values, their codes in wire, their headers)`` views, one cache
    piece of blocks at a time on CPU, every block at once elsewhere."""
    piece = max(1, PIECE // block_size) if values.device.type == "cpu" else 1 << 62
    for first, count, m, start, c in _layout(values.numel(), codec, block_size):
        rows = values[start : start + count * m].view(count, m)
        codes = wire[c : c + count * _code_bytes(m, codec)].view(count, -1)
        for i in range(0, count, piece):
            j = min(count, i + piece)
            yield rows[i:j], codes[i:j], hdr[first + i : first + j]


def _fused(values: torch.Tensor, wire: torch.Tensor, block_size: int) -> bool:
    """Whether to run the Triton kernels (CUDA, Triton, ``BAGUA_FUSED_CODECS`` not ``0``, a block that fits)."""
    return (triton_kernels.enabled(values) and block_size <= triton_kernels.MAX_BLOCK and wire.is_contiguous()
            and values.is_contiguous())


def _split(k: int, *tensors: torch.Tensor):
    """The pieces of ``k`` rows of every tensor, side by side."""
    return zip(*(t.split(k) for t in tensors))


def decode(wire: torch.Tensor, numel: int, codec: str, block_size: int = DEFAULT_BLOCK,
           out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """Decode ``numel`` float32 values from ``wire`` into ``out``, or add them to ``out`` with ``accumulate``.

    ``accumulate`` adds the decoded values in float32, bit-identical to decoding into a temporary and adding
    it (a scatter-reduce sums the ranks' copies of a chunk one after the other this way).

    Args:
        wire: 1-D uint8 tensor from :func:`encode` (``wire_numel(numel, codec, block_size)`` bytes).
        numel: number of values encoded.
        codec: one of :data:`CODECS`, as encoded.
        block_size: as encoded.
        out: 1-D float32 tensor of ``numel`` elements; a new one otherwise (required with ``accumulate``).
        accumulate: add to ``out`` instead of overwriting it.

    Returns:
        ``out``.

    Example:
        >>> decode(encode(torch.tensor([0.0, 0.5, 1.0]), "uint8"), 3, "uint8")
        tensor([0.0000, 0.5020, 1.0000])
    """
    _check_wire(wire, wire_numel(numel, codec, block_size), "wire")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True adds to out: pass the out tensor")
        out = torch.empty(numel, dtype=torch.float32, device=wire.device)
    elif out.dtype != torch.float32 or out.dim() != 1 or out.numel() != numel or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-D float32 tensor of {numel} elements, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if codec == "topk":
        return sparse.decode(wire, numel, block_size, out, accumulate)
    if codec == "bf16":
        values = (wire if wire.storage_offset() % 2 == 0 else wire.clone()).view(torch.bfloat16)
        if not accumulate:
            return out.copy_(values)
        k = PIECE if out.device.type == "cpu" else max(numel, 1)
        w = torch.empty(min(k, numel), dtype=torch.float32, device=out.device)
        for v, o in _split(k, values, out):  # bfloat16 + float32 in one op is about 10x slower
            o.add_(w[: v.numel()].copy_(v))
        return out
    if codec in _ROW_CODECS:
        hdr = _header(wire, -(-numel // block_size))
        for rows, codes, piece_hdr in _row_pieces(out, wire, hdr, codec, block_size):
            _ROW_CODECS[codec].decode_rows(codes, piece_hdr, rows, accumulate)
        return out
    if _fused(out, wire, block_size):
        return triton_kernels.block_decode(wire, numel, codec, block_size, out, accumulate)
    levels = _LEVELS[codec]
    blocks = -(-numel // block_size)
    hdr = _header(wire, blocks)
    mn, mx = hdr[:, 0:1], hdr[:, 1:2]
    pairs = levels == 15
    if pairs:  # [r / L, r / (16 L)] per block, for _dequantize_pairs: the second is step / 16 where that is exact
        steps = torch.div(mx - mn, constant((15.0, 240.0), torch.float32, wire.device, (1, 2))).unsqueeze(2)
    else:
        steps = _step(mn, mx, levels)
    special = _huge(hdr)  # blocks decoded one by one: huge ones, and for uint4 those where step / 16 is inexact
    if pairs:
        special |= (steps[:, 0, 0] > 0) & (steps[:, 0, 0] < 2.0**-122)
    special = special.nonzero().view(-1).tolist() if blocks else []
    for first, count, m, start, c in _layout(numel, codec, block_size):
        rows = out[start : start + count * m].view(count, m)
        codes = wire[c : c + count * _code_bytes(m, codec)].view(count, -1)
        k, scratch = _pieces(rows, levels, floats=accumulate)
        i = first
        for ca, mna, sta, ra in _split(k, codes, mn[first : first + count], steps[first : first + count], rows):
            b = scratch if ca.shape[0] == scratch.k else _Scratch(ca.shape[0], m, levels, out.device, accumulate)
            dst = b.w if accumulate else ra
            if pairs and m % 2 == 0:
                _dequantize_pairs(ca, mna, sta, dst, b)
            else:
                _dequantize(ca, mna, sta[:, :1, 0] if pairs else sta, dst, b)
            for h in special:
                if i <= h < i + ca.shape[0]:
                    _decode_one(ca[h - i : h - i + 1], hdr[h], dst[h - i : h - i + 1], levels)
            if accumulate:
                ra.add_(dst)
            i += ca.shape[0]
    return out


def error_bound(x: torch.Tensor, codec: str, block_size: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Return the bound on ``|x - decode(encode(x))|`` of the module docstring, per element (shaped like ``x``).

    Inf for the elements of a block holding a NaN or an Inf (and, in ``bf16``, for those that overflow).

    Example:
        >>> error_bound(torch.tensor([0.0, 1.0]), "uint8")  # half a step: 1 / 510, plus 2**-19
        tensor([0.0020, 0.0020])
    """
    x = _check_x(x)
    _check(codec, block_size)
    if codec == "topk":  # a dropped value is off by itself, a kept one by half a step of its block's scale
        return sparse.error_bound(x, block_size)
    if codec == "bf16":
        bound = x.abs() * 2.0**-8 + 2.0**-134
        return bound.masked_fill_(~(x.abs() < _BF16_OVERFLOW), float("inf"))
    if codec in _ROW_CODECS:
        parts = [_ROW_CODECS[codec].error_bound_rows(x[start : start + count * m].view(count, m)).reshape(-1)
                 for _, count, m, start, _ in _layout(x.numel(), codec, block_size)]
        return torch.cat(parts).float() if parts else x.new_empty(0)
    levels = _LEVELS[codec]
    bounds = []
    for _, count, m, start, _ in _layout(x.numel(), codec, block_size):
        rows = x[start : start + count * m].view(count, m)
        mn, mx = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)
        big = torch.maximum(mn.abs(), mx.abs()) >= _HUGE
        # the encoder's s, on the halved values where it halves
        half = torch.where(big, 0.5, 1.0)
        flat = _scale(mn * half, mx * half, levels) == 0
        lo, hi, top = mn.double(), mx.double(), torch.maximum(mn.abs(), mx.abs()).double()
        bound = torch.where(flat, hi - lo, (hi - lo) / (2 * levels) + 2.0**-19 * top)
        bound = bound.masked_fill_(~(torch.isfinite(mn) & torch.isfinite(mx)), float("inf"))
        up = bound.float()  # rounded up to float32, so that it stays a bound
        up = torch.where(up.double() < bound, torch.nextafter(up, torch.full_like(up, float("inf"))), up)
        bounds.append(up.expand(count, m).reshape(-1))
    return torch.cat(bounds) if bounds else x.new_empty(0)
