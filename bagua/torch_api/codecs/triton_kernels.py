"""Triton kernels of the codecs: one pass over memory per operation, bit-identical to the CPU reference.

The kernels compute exactly the float32 operations of the CPU code (:mod:`~bagua.torch_api.codecs.block` and
:mod:`~bagua.torch_api.codecs.minmax_uint8`), in the same order, so they write the same bytes and values:

- every division is a correctly rounded one (``tl.div_rn``; Triton's ``/`` is an approximate division on CUDA);
- no multiply-add is fused into one rounding (the kernels are compiled with ``enable_fp_fusion=False``);
- rounding to an integer is an addition and subtraction of ``2**23`` (round half to even, as ``torch.round``);
- torch's ``255.0 / t`` is ``reciprocal(t) * 255``, and the kernels do the same;
- a NaN in a block or chunk header is the canonical quiet NaN (``0x7fc00000``), as torch's ``amin``/``amax`` give;
- a zero minimum or maximum is written as +0 (the CPU code adds 0 too: the sign a reduction keeps is its order's).

The kernels are imported on first use. With ``TRITON_INTERPRET=1`` set before Triton is first imported (Triton reads
it once), they run on CPU tensors through Triton's interpreter: the CI equality tests do this. :func:`enabled` says whether the codecs use the
kernels for a tensor: CUDA tensors when Triton imports and ``BAGUA_FUSED_CODECS`` is not ``0``; CPU tensors only
under the interpreter when a caller asks for it explicitly (the CPU code is faster there).

Example (on a CUDA machine with Triton; the codecs call these for CUDA tensors by themselves):
    >>> x = torch.randn(1 << 20, device="cuda")
    >>> wire = block_encode(x, "uint4", 4096)                                 # doctest: +SKIP
    >>> y = block_decode(wire, x.numel(), "uint4", 4096)                      # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Optional

import torch

__all__ = ["MAX_BLOCK", "available", "enabled", "block_encode", "block_decode", "chunks_minmax", "chunks_encode",
           "chunks_decode", "chunks_decode_sum"]

#: Largest block size the block-code kernels hold in registers; larger blocks take the eager path.
MAX_BLOCK = 16384
_TILE = 2048  # elements per program of the MinMaxUInt8 kernels
_LEVELS = {"uint8": 255, "uint4": 15}


@functools.lru_cache(maxsize=None)
def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a Triton that cannot load its driver
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> bool:
    """Return whether Triton imports here (the kernels can be built)."""
    return _triton_ok()


def enabled(t: torch.Tensor) -> bool:
    """Return whether the codecs use these kernels for tensors like ``t``: a CUDA tensor, Triton importable,
    ``BAGUA_FUSED_CODECS`` not ``0``, and not under the interpreter (which is for tests, on CPU tensors)."""
    return (t.device.type == "cuda" and os.environ.get("BAGUA_FUSED_CODECS", "1") != "0"
            and not _interpreting() and _triton_ok())


def _k() -> ModuleType:
    """The kernels' module, imported on first use (Triton is optional)."""
    from bagua.torch_api.codecs import _triton_source

    return _triton_source


def _launch(kernel, grid, *args, **meta) -> None:
    if _interpreting():
        kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, enable_fp_fusion=False, **meta)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _float_view(raw: torch.Tensor) -> Optional[torch.Tensor]:
    """``raw`` (uint8) as float32 when its start is 4-byte aligned, else ``None``."""
    return raw.view(torch.float32) if raw.storage_offset() % 4 == 0 and raw.numel() % 4 == 0 else None


def block_encode(x: torch.Tensor, codec: str, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """Write the ``uint8``/``uint4`` block code of the 1-D float32 ``x`` into the wire ``out`` (see
    :func:`bagua.torch_api.codecs.block.encode`, which checks the arguments and calls this for CUDA tensors)."""
    n = x.numel()
    blocks = -(-n // block_size)
    if blocks == 0:
        return out
    header = 8 * blocks
    hdr = _float_view(out[:header])
    tmp = hdr is None
    if tmp:
        hdr = torch.empty(2 * blocks, dtype=torch.float32, device=x.device)
    levels = _LEVELS[codec]
    pack = codec == "uint4"
    per_block = block_size if not pack else (block_size + 1) // 2
    width = _pow2(per_block)
    kernel = _k().block_encode_u4 if pack else _k().block_encode_u8
    for first, count, m, codes in _runs(n, block_size, per_block, header):
        _launch(kernel, (count,), x[first * block_size:], hdr[2 * first:], out[codes:], m, (m + 1) // 2,
                per_block, LEVELS=levels, WIDTH=width, num_warps=_warps(block_size))
    if tmp:
        out[:header].copy_(hdr.view(torch.uint8))
    return out


def block_decode(wire: torch.Tensor, numel: int, codec: str, block_size: int, out: torch.Tensor,
                 accumulate: bool) -> torch.Tensor:
    """Decode (or with ``accumulate`` add) the block code ``wire`` into the float32 ``out`` (see
    :func:`bagua.torch_api.codecs.block.decode`)."""
    blocks = -(-numel // block_size)
    if blocks == 0:
        return out
    header = 8 * blocks
    hdr = _float_view(wire[:header])
    if hdr is None:
        hdr = wire[:header].clone().view(torch.float32)
    pack = codec == "uint4"
    per_block = block_size if not pack else (block_size + 1) // 2
    width = _pow2(per_block)
    kernel = _k().block_decode_u4 if pack else _k().block_decode_u8
    for first, count, m, codes in _runs(numel, block_size, per_block, header):
        _launch(kernel, (count,), wire[codes:], hdr[2 * first:], out[first * block_size:], m, (m + 1) // 2,
                per_block, LEVELS=_LEVELS[codec], ACCUMULATE=accumulate, WIDTH=width, num_warps=_warps(block_size))
    return out


def _runs(n: int, block_size: int, per_block: int, header: int) -> list[tuple[int, int, int, int]]:
    """``(first block, blocks, elements per block, code byte offset)`` of the full blocks, then the short last one.

    One launch per run: every block of a launch has the same length, so its halves (uint4) start at a multiple of
    16 elements that Triton knows of, and loads and stores are vectorized (2048 at the default block)."""
    full, tail = divmod(n, block_size)
    runs = [(0, full, block_size, header)] if full else []
    if tail:
        runs.append((full, 1, tail, header + full * per_block))
    return runs


def _warps(block_size: int) -> int:
    # by the elements a program holds: a uint4 block of 4096 is two halves of 2048, and wants 8 warps as uint8's
    return 4 if block_size <= 2048 else 8


def chunks_minmax(x: torch.Tensor) -> torch.Tensor:
    """The ``(n, 2)`` float32 min and max of every row of the float32 ``x`` (rows of unit stride; NaN where a row
    holds one). Two launches: the min and max of tiles, then of each row's tiles."""
    n, length = x.shape
    tiles = -(-length // _TILE)
    part = torch.empty(n, tiles, 2, dtype=torch.float32, device=x.device)
    _launch(_k().tile_minmax, (n, tiles), x, part, length, x.stride(0), tiles, TILE=_TILE, num_warps=4)
    out = torch.empty(n, 2, dtype=torch.float32, device=x.device)
    _launch(_k().row_minmax, (n,), part, out, tiles, WIDTH=min(_pow2(tiles), 1024), num_warps=4)
    return out


def chunks_encode(x: torch.Tensor, wire: torch.Tensor, minmax: torch.Tensor, header: bool = True) -> None:
    """Write the MinMaxUInt8 wire of the rows of the float32 ``x`` (``(n, L)``, rows of unit stride) with their
    ``(n, 2)`` ``minmax`` (see :func:`bagua.torch_api.codecs.minmax_uint8.encode_chunks`); without ``header``,
    only the codes, into ``wire`` of shape ``(n, L)`` (:func:`~bagua.torch_api.codecs.minmax_uint8.encode_pieces`)."""
    n, length = x.shape
    _launch(_k().chunks_encode, (n, -(-length // _TILE)), x, minmax, wire, length, x.stride(0), wire.stride(0),
            HEADER=header, TILE=_TILE, num_warps=4)


def chunks_decode(wire: torch.Tensor, out: torch.Tensor, accumulate: bool,
                  minmax: Optional[torch.Tensor] = None) -> None:
    """Decode (or add) the MinMaxUInt8 ``wire`` into the float32 ``out`` (``(n, L)``, rows of unit stride), with
    the chunks' ``(n, 2)`` ``minmax`` when known (read from the wire's headers otherwise)."""
    n, length = out.shape
    hdr = _headers(wire) if minmax is None else minmax
    _launch(_k().chunks_decode, (n, -(-length // _TILE)), wire, hdr, out, length, wire.stride(0), out.stride(0), n,
            SUM=False, ACCUMULATE=accumulate, TILE=_TILE, num_warps=4)


def chunks_decode_sum(wire: torch.Tensor, out: torch.Tensor, minmax: Optional[torch.Tensor] = None) -> None:
    """Write into the contiguous float32 ``out`` (``L`` elements) the sum of the ``n`` decoded rows of ``wire``,
    added in row order."""
    n = wire.shape[0]
    length = out.numel()
    hdr = _headers(wire) if minmax is None else minmax
    _launch(_k().chunks_decode, (1, -(-length // _TILE)), wire, hdr, out, length, wire.stride(0), 0, n,
            SUM=True, ACCUMULATE=False, TILE=_TILE, num_warps=4)


def _headers(wire: torch.Tensor) -> torch.Tensor:
    """The ``(n, 2)`` float32 min and max at the start of every row of ``wire`` (rows are not 4-byte aligned)."""
    return wire[:, :8].contiguous().view(torch.float32)
