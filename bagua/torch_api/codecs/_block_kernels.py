"""The block codecs' inner loops on CPU: quantize and dequantize ``(k, m)`` rows of blocks through a scratch piece.

Private to :mod:`~bagua.torch_api.codecs.block`, whose docstring states the formulas (and whose ``encode`` and
``decode`` are the only callers); the Triton kernels (:mod:`~bagua.torch_api.codecs._triton_source`) mirror them.
"""

from __future__ import annotations

import torch
from bagua.torch_api.codecs._constants import constant

__all__ = ["PIECE"]

#: Elements per cache piece on CPU.
PIECE = 1 << 18

_MAGIC = float(1 << 23)
_HUGE = 2.0**126


def _scale(mn: torch.Tensor, mx: torch.Tensor, levels: int) -> torch.Tensor:
    """``s = L / (max - min)``, 0 where not finite (``L`` a tensor, here and in :func:`_step`: torch divides by a
    scalar as a multiplication by its reciprocal)."""
    r = mx - mn
    return torch.div(torch.full_like(r, levels), r).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def _step(mn: torch.Tensor, mx: torch.Tensor, levels: int) -> torch.Tensor:
    """``r / L``."""
    r = mx - mn
    return torch.div(r, torch.full_like(r, levels))


class _Scratch:
    """The buffers of ``k`` blocks of ``m`` elements and their views, made once per call (on CPU a view costs
    about as much as a small operation, so the loops take them ready-made)."""

    __slots__ = ("k", "levels", "w", "bits", "lo", "hi", "lo_head", "lo_bits", "nibbles", "nibble_rows")

    def __init__(self, k: int, m: int, levels: int, device: torch.device, floats: bool = True) -> None:
        self.k, self.levels = k, levels
        h = (m + 1) // 2
        self.w = torch.empty(k, m, dtype=torch.float32, device=device) if floats else None
        if floats:
            self.bits = self.w.view(torch.int32)
            self.lo, self.hi = self.w[:, :h], self.w[:, h:]
            self.lo_head, self.lo_bits = self.lo[:, : m - h], self.lo.view(torch.int32)
        self.nibbles = torch.empty(k, 2, h, dtype=torch.uint8, device=device) if levels == 15 else None
        if self.nibbles is not None:
            self.nibble_rows = self.nibbles.view(k, 2 * h)[:, :m]  # low nibbles then high: the block in order


def _pieces(rows: torch.Tensor, levels: int, floats: bool) -> tuple[int, _Scratch]:
    """Blocks per piece (all of them on devices other than CPU) and the scratch of a full piece."""
    count, m = rows.shape
    k = max(1, PIECE // m) if rows.device.type == "cpu" else max(count, 1)
    return k, _Scratch(min(k, count), m, levels, rows.device, floats)


def _quantize(x: torch.Tensor, mn: torch.Tensor, s: torch.Tensor, codes: torch.Tensor, b: _Scratch) -> None:
    """Write the codes of the ``(k, m)`` rows ``x`` (min ``mn``, scale ``s``: ``(k, 1)``) into ``codes``."""
    torch.sub(x, mn, out=b.w)
    b.w.mul_(s)
    if b.levels == 255:
        b.w.add_(_MAGIC)
        codes.copy_(b.bits)  # int32 -> uint8 keeps the low byte: q
        return
    b.lo.add_(_MAGIC)
    b.lo_head.add_(b.hi.round_(), alpha=16)  # 2**23 + q_lo + 16 q_hi: exact integers
    codes.copy_(b.lo_bits)


def _dequantize(codes: torch.Tensor, mn: torch.Tensor, step: torch.Tensor, w: torch.Tensor, b: _Scratch) -> None:
    """Write ``min + q * step`` of the ``(k, bytes)`` codes into the ``(k, m)`` float32 ``w`` (the formula as
    written; :func:`_dequantize_pairs` is the faster uint4 path for blocks of even length)."""
    if b.levels == 255:
        w.copy_(codes)
    else:  # both nibbles in one broadcast shift, (k, 1, h) >> (1, 2, 1): rows of [low nibbles, high nibbles]
        shifts = constant((0, 4), torch.uint8, codes.device, (1, 2, 1))
        torch.bitwise_right_shift(codes.unsqueeze(1), shifts, out=b.nibbles)
        w.copy_(b.nibbles.bitwise_and_(15).view(w.shape[0], -1)[:, : w.shape[1]])
    w.mul_(step).add_(mn)


def _dequantize_pairs(codes: torch.Tensor, mn: torch.Tensor, steps: torch.Tensor, w: torch.Tensor,
                      b: _Scratch) -> None:
    """:func:`_dequantize` for uint4 blocks of even length, with ``steps = [step, step / 16]`` (``(k, 2, 1)``).

    One broadcast mask gives ``q_lo`` and ``16 q_hi`` (x86 has no 8-bit shift: a shift costs as much as the rest
    of the unpacking); ``16 q_hi * (step / 16)`` is the real number ``q_hi * step``, so it rounds to the same
    float32 wherever ``step / 16`` is exact: everywhere but for ``0 < step < 2**-122``, blocks that
    :func:`decode` redoes with :func:`_dequantize`.
    """
    torch.bitwise_and(codes.unsqueeze(1), constant((0x0F, 0xF0), torch.uint8, codes.device, (1, 2, 1)), out=b.nibbles)
    w.copy_(b.nibble_rows)
    w.view(w.shape[0], 2, -1).mul_(steps)
    w.add_(mn)


def _huge(hdr: torch.Tensor) -> torch.Tensor:
    """Whether each block is finite with ``max(|min|, |max|) >= 2**126``."""
    m = hdr.abs().amax(dim=1)
    return (m >= _HUGE) & torch.isfinite(m)


def _decode_one(codes: torch.Tensor, minmax: torch.Tensor, row: torch.Tensor, levels: int) -> None:
    """Decode one block into the ``(1, m)`` row with :func:`_dequantize`; a huge block as
    ``clamp(2 * (min/2 + q * (r/2 / L)), min, max)``."""
    huge = bool(_huge(minmax.view(1, 2)))
    mm = (minmax * (0.5 if huge else 1.0)).view(1, 2)
    mn, mx = mm[:, 0:1], mm[:, 1:2]
    _dequantize(codes, mn, _step(mn, mx, levels), row, _Scratch(1, row.shape[1], levels, row.device, floats=False))
    if huge:
        row.mul_(2.0).clamp_(float(minmax[0]), float(minmax[1]))
