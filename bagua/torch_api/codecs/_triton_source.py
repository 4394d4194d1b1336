"""The Triton kernels of :mod:`bagua.torch_api.codecs.triton_kernels`.

Each kernel is the CPU code's float32 arithmetic, operation for operation (module docstring of
``triton_kernels``); the comments name the CPU lines they follow. Imported only when Triton is there, and
``triton.jit`` decides at import whether the kernels run compiled or interpreted (``TRITON_INTERPRET``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["block_encode_u8", "block_encode_u4", "block_decode_u8", "block_decode_u4", "tile_minmax", "row_minmax",
           "chunks_encode", "chunks_decode"]


@triton.jit
def _nan():
    return tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _rint(y):
    # torch.round: half to even. Below 2**23 adding and taking away 2**23 rounds so; above, y is an integer
    a = tl.abs(y)
    r = (a + 8388608.0) - 8388608.0
    r = tl.where(y < 0, -r, r)
    return tl.where(a < 8388608.0, r, y)


@triton.jit
def _min_max(x, mask):
    return _min_max2(x, mask, x, mask)


@triton.jit
def _min_max2(a, mask_a, b, mask_b):
    # torch.amin / amax of a and b together: NaN wins (as the canonical NaN; both are NaN then: the GPU's min and
    # max pass over a NaN, so a third reduction looks for one); padding is +-inf. Plus 0: a zero minimum or
    # maximum is +0 whatever the signs met (block.encode and ChunkParams do the same). tl.min, not a reduction
    # with a NaN-propagating combine: the interpreter runs a combine function element by element (50x slower)
    lo = tl.minimum(tl.where(mask_a, a, float("inf")), tl.where(mask_b, b, float("inf")))
    hi = tl.maximum(tl.where(mask_a, a, float("-inf")), tl.where(mask_b, b, float("-inf")))
    nan = tl.where((mask_a & (a != a)) | (mask_b & (b != b)), 1, 0)
    has_nan = tl.max(nan, axis=0) > 0
    mn = tl.min(lo, axis=0) + 0.0
    mx = tl.max(hi, axis=0) + 0.0
    return tl.where(has_nan, _nan(), mn), tl.where(has_nan, _nan(), mx), has_nan


@triton.jit
def _huge(mn, mx):
    # _block_kernels._huge: finite with max(|min|, |max|) >= 2**126 (NaN compares false)
    m = tl.maximum(tl.abs(mn), tl.abs(mx))
    return (m >= 2.0**126) & (m < float("inf"))


@triton.jit
def _block_scale(mns, mxs, LEVELS: tl.constexpr):
    # _block_kernels._scale: s = L / r, 0 where that is not finite
    s = tl.div_rn(tl.full([], LEVELS, tl.float32), mxs - mns)
    return tl.where(tl.abs(s) < float("inf"), s, 0.0)


@triton.jit
def _block_codes(x, huge, mns, s):
    # _block_kernels._quantize: (x - min) * s + 2**23, whose float32 bits end in the code (x halved on huge blocks)
    xs = tl.where(huge, x * 0.5, x)
    y = (xs - mns) * s + 8388608.0
    return y.to(tl.int32, bitcast=True) & 0xFF


@triton.jit
def _block_prologue(hdr_ptr, pid, mn, mx, has_nan, LEVELS: tl.constexpr):
    tl.store(hdr_ptr + 2 * pid, mn)
    tl.store(hdr_ptr + 2 * pid + 1, mx)
    huge = _huge(mn, mx)
    mns = tl.where(huge, mn * 0.5, mn)
    mxs = tl.where(huge, mx * 0.5, mx)
    bad = has_nan | (tl.abs(mn) == float("inf")) | (tl.abs(mx) == float("inf"))
    return huge, mns, _block_scale(mns, mxs, LEVELS), bad


@triton.jit
def block_encode_u8(x_ptr, hdr_ptr, codes_ptr, m, half, per_block, LEVELS: tl.constexpr,
                    WIDTH: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * m
    offs = tl.arange(0, WIDTH)
    mask = offs < m
    x = tl.load(x_ptr + start + offs, mask=mask, other=0.0)
    mn, mx, has_nan = _min_max(x, mask)
    huge, mns, s, bad = _block_prologue(hdr_ptr, pid, mn, mx, has_nan, LEVELS)
    q = tl.where(bad, 0, _block_codes(x, huge, mns, s))
    tl.store(codes_ptr + pid.to(tl.int64) * per_block + offs, q.to(tl.uint8), mask=mask)


@triton.jit
def block_encode_u4(x_ptr, hdr_ptr, codes_ptr, m, half, per_block, LEVELS: tl.constexpr,
                    WIDTH: tl.constexpr):
    # byte i of a block of m holds element i (low nibble) and element i + ceil(m/2) (high nibble, 0 past m)
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * m
    h = half
    offs = tl.arange(0, WIDTH)
    mask_lo = offs < h
    mask_hi = offs < m - h
    lo = tl.load(x_ptr + start + offs, mask=mask_lo, other=0.0)
    hi = tl.load(x_ptr + start + h + offs, mask=mask_hi, other=0.0)
    mn, mx, has_nan = _min_max2(lo, mask_lo, hi, mask_hi)
    huge, mns, s, bad = _block_prologue(hdr_ptr, pid, mn, mx, has_nan, LEVELS)
    q = _block_codes(lo, huge, mns, s) + 16 * tl.where(mask_hi, _block_codes(hi, huge, mns, s), 0)
    q = tl.where(bad, 0, q)
    tl.store(codes_ptr + pid.to(tl.int64) * per_block + offs, q.to(tl.uint8), mask=mask_lo)


@triton.jit
def _block_values(q, mn, mx, LEVELS: tl.constexpr):
    # _block_kernels._dequantize: min + q * (r / L); huge blocks: clamp(2 * (min/2 + q * (r/2 / L)), min, max)
    huge = _huge(mn, mx)
    mns = tl.where(huge, mn * 0.5, mn)
    mxs = tl.where(huge, mx * 0.5, mx)
    step = tl.div_rn(mxs - mns, tl.full([], LEVELS, tl.float32))
    v = q.to(tl.float32) * step + mns
    return tl.where(huge, tl.minimum(tl.maximum(v * 2.0, mn), mx), v)


@triton.jit
def _store_values(out_ptr, v, mask, ACCUMULATE: tl.constexpr):
    if ACCUMULATE:
        v = tl.load(out_ptr, mask=mask, other=0.0) + v
    tl.store(out_ptr, v, mask=mask)


@triton.jit
def block_decode_u8(codes_ptr, hdr_ptr, out_ptr, m, half, per_block, LEVELS: tl.constexpr,
                    ACCUMULATE: tl.constexpr, WIDTH: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * m
    offs = tl.arange(0, WIDTH)
    mask = offs < m
    mn = tl.load(hdr_ptr + 2 * pid)
    mx = tl.load(hdr_ptr + 2 * pid + 1)
    q = tl.load(codes_ptr + pid.to(tl.int64) * per_block + offs, mask=mask, other=0)
    _store_values(out_ptr + start + offs, _block_values(q, mn, mx, LEVELS), mask, ACCUMULATE)


@triton.jit
def block_decode_u4(codes_ptr, hdr_ptr, out_ptr, m, half, per_block, LEVELS: tl.constexpr,
                    ACCUMULATE: tl.constexpr, WIDTH: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * m
    h = half
    offs = tl.arange(0, WIDTH)
    mn = tl.load(hdr_ptr + 2 * pid)
    mx = tl.load(hdr_ptr + 2 * pid + 1)
    b = tl.load(codes_ptr + pid.to(tl.int64) * per_block + offs, mask=offs < h, other=0).to(tl.int32)
    _store_values(out_ptr + start + offs, _block_values(b & 15, mn, mx, LEVELS), offs < h, ACCUMULATE)
    _store_values(out_ptr + start + h + offs, _block_values(b >> 4, mn, mx, LEVELS), offs < m - h, ACCUMULATE)


@triton.jit
def tile_minmax(x_ptr, part_ptr, length, xstride, tiles, TILE: tl.constexpr):
    row = tl.program_id(0)
    t = tl.program_id(1)
    offs = t * TILE + tl.arange(0, TILE)
    mask = offs < length
    x = tl.load(x_ptr + row.to(tl.int64) * xstride + offs, mask=mask, other=0.0)
    mn, mx, _ = _min_max(x, mask)
    p = (row.to(tl.int64) * tiles + t) * 2
    tl.store(part_ptr + p, mn)
    tl.store(part_ptr + p + 1, mx)


@triton.jit
def row_minmax(part_ptr, out_ptr, tiles, WIDTH: tl.constexpr):
    row = tl.program_id(0)
    base = part_ptr + row.to(tl.int64) * tiles * 2
    mn = tl.full([], float("inf"), tl.float32)
    mx = tl.full([], float("-inf"), tl.float32)
    nan = tl.full([], 0, tl.int1)
    for t0 in range(0, tiles, WIDTH):
        offs = t0 + tl.arange(0, WIDTH)
        mask = offs < tiles
        a, _, na = _min_max(tl.load(base + 2 * offs, mask=mask, other=0.0), mask)
        _, b, nb = _min_max(tl.load(base + 2 * offs + 1, mask=mask, other=0.0), mask)
        mn = tl.minimum(mn, a)
        mx = tl.maximum(mx, b)
        nan = nan | na | nb
    tl.store(out_ptr + 2 * row, tl.where(nan, _nan(), mn))
    tl.store(out_ptr + 2 * row + 1, tl.where(nan, _nan(), mx))


@triton.jit
def _chunk_params(mn, mx):
    # codec_format._scale_lower: scale = 255 / (max - min + eps), which torch computes as reciprocal * 255;
    # upper = round(max * scale); lower = upper - 255
    d = (mx - mn) + 1e-7
    scale = tl.div_rn(tl.full([], 1.0, tl.float32), d) * 255.0
    return scale, _rint(mx * scale) - 255.0


@triton.jit
def chunks_encode(x_ptr, mm_ptr, wire_ptr, length, xstride, wstride, HEADER: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0)
    t = tl.program_id(1)
    mn = tl.load(mm_ptr + 2 * row) + 0.0  # ChunkParams: a zero min or max is +0
    mx = tl.load(mm_ptr + 2 * row + 1) + 0.0
    scale, lower = _chunk_params(mn, mx)
    offs = t * TILE + tl.arange(0, TILE)
    mask = offs < length
    x = tl.load(x_ptr + row.to(tl.int64) * xstride + offs, mask=mask, other=0.0)
    # minmax_uint8._encode_whole: clamp(round(x * scale) - lower, 0, 255)
    v = tl.minimum(tl.maximum(_rint(x * scale) - lower, 0.0), 255.0)
    wrow = wire_ptr + row.to(tl.int64) * wstride
    tl.store(wrow + 8 * HEADER + offs, v.to(tl.int32).to(tl.uint8), mask=mask)
    if HEADER:
        if t == 0:  # the header: the float32 bytes of min and max, little-endian
            j = tl.arange(0, 8)
            word = tl.where(j < 4, mn.to(tl.int32, bitcast=True), mx.to(tl.int32, bitcast=True))
            tl.store(wrow + j, ((word >> (8 * (j % 4))) & 0xFF).to(tl.uint8))


@triton.jit
def _chunk_values(wire_ptr, hdr_ptr, row, wstride64, offs, mask):
    # minmax_uint8.decode_chunks: (q + lower) / scale
    scale, lower = _chunk_params(tl.load(hdr_ptr + 2 * row), tl.load(hdr_ptr + 2 * row + 1))
    q = tl.load(wire_ptr + row * wstride64 + 8 + offs, mask=mask, other=0).to(tl.float32)
    return tl.div_rn(q + lower, scale)


@triton.jit
def chunks_decode(wire_ptr, hdr_ptr, out_ptr, length, wstride, ostride, n, SUM: tl.constexpr,
                  ACCUMULATE: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = offs < length
    wstride64 = wstride.to(tl.int64)  # the loop's row is a plain int under the interpreter
    v = _chunk_values(wire_ptr, hdr_ptr, row, wstride64, offs, mask)
    if SUM:  # decode_sum_chunks: ((d_0 + d_1) + d_2) + ...
        for i in range(1, n):
            v = v + _chunk_values(wire_ptr, hdr_ptr, i, wstride64, offs, mask)
    _store_values(out_ptr + row.to(tl.int64) * ostride + offs, v, mask, ACCUMULATE)
