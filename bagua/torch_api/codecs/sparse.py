"""A sparse codec, ``topk``: per block, the largest values in magnitude, their positions, and 4 bits per value.

For pseudo-gradients on links where bits alone no longer help (SparseLoCo, https://arxiv.org/abs/2508.15706: top-k
of 1-3 % plus 2-bit values with error feedback). A 1-D float32 tensor of ``n`` elements splits into blocks of
``block_size`` consecutive elements (the last one may be short); a block of ``m`` elements keeps its
``k(m) = ceil(m / 32)`` values of largest magnitude (:data:`DENSITY` = 1/32, 3.1 %). Per block, in float32::

    s  = max |x_i| over the kept i               (the block's scale; s = 0 decodes every kept value to 0)
    q  = round_half_even(x_i / s * 7)            (an integer in [-7, 7], stored as q + 8 in 4 bits)
    x' = q * (s / 7)  at the kept positions, 0 elsewhere

so a kept value is off by at most ``s / 14`` (plus float32 rounding) and a dropped one by its own magnitude: what
error feedback carries to the next exchange. A block holding a NaN or an Inf decodes to NaN everywhere, which
callers detect.

Wire layout: every block's float32 scale first (4 bytes each), then every block's ``k`` positions within the block
(one byte each for blocks of at most 256 elements, else two, little-endian), then every block's codes, two per byte
(byte ``i`` of a block's codes holds code ``i`` in its low nibble and code ``i + ceil(k / 2)`` in its high one).
At ``block_size=4096``: ``4 + 128 * 2 + 64`` bytes per 4096 values, 0.63 bits per value (``uint4``: 4.02);
at ``block_size=256``: ``4 + 8 + 4`` bytes per 256 values, 0.5 bits per value.

A sparse average cannot be re-sparsified without loss, so the exchange is an all-gather of the members' wires,
decoded and summed in member order by every member (bit-identical averages everywhere):
:func:`~bagua.torch_api.codecs.workspace.allgather_average`, and
:func:`~bagua.torch_api.codecs.block_allreduce.block_allreduce_inplace` for a communicator. A rank sends ``(N - 1)``
wires: at 4 ranks and ``block_size=256``, 1.5 bits per value against ``uint4``'s 6 through a scatter-reduce-gather.

Example:
    >>> x = torch.zeros(256); x[3], x[100] = 1.0, -0.5
    >>> y = decode(encode(x, 256), 256, 256)
    >>> y[3].item(), y[100].item(), int((y != 0).sum())
    (1.0, -0.5714285969734192, 2)
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["DENSITY", "kept", "wire_numel", "encode", "decode", "error_bound"]

#: the share of each block's values kept
DENSITY = 1 / 32
_LEVELS = 7  # codes -7..7 about zero
_SCALE_BYTES = 4


def kept(m: int) -> int:
    """The values a block of ``m`` elements keeps: ``ceil(m * DENSITY)`` (at least one)."""
    return max(1, -(-m * 1 // 32)) if m else 0


def _index_bytes(block_size: int) -> int:
    return 1 if block_size <= 256 else 2


def _check(block_size: int) -> None:
    if not 2 <= block_size <= 65536:
        raise ValueError(f"the topk codec takes block_size from 2 to 65536 (positions are 8 or 16 bits), got "
                         f"{block_size}; 256 keeps positions in one byte")


def _runs(numel: int, block_size: int) -> list[tuple[int, int, int]]:
    """The runs of equal blocks: ``(first block, blocks, block length)``."""
    full, tail = divmod(numel, block_size)
    return ([(0, full, block_size)] if full else []) + ([(full, 1, tail)] if tail else [])


def _sizes(numel: int, block_size: int) -> tuple[int, int, int]:
    """(blocks, kept values over all blocks, position bytes per value)."""
    runs = _runs(numel, block_size)
    return sum(c for _, c, _ in runs), sum(c * kept(m) for _, c, m in runs), _index_bytes(block_size)


def wire_numel(numel: int, block_size: int = 256) -> int:
    """Return the bytes on the wire for ``numel`` float32 values: per block of ``m`` elements, 4 + ``k(m)`` position
    bytes (two each past 256-element blocks) + ``ceil(k(m) / 2)``.

    Example:
        >>> wire_numel(4096, 256), wire_numel(4096, 4096)
        (256, 324)
    """
    _check(block_size)
    total = 0
    for _, count, m in _runs(numel, block_size):
        k = kept(m)
        total += count * (_SCALE_BYTES + k * _index_bytes(block_size) + (k + 1) // 2)
    return total


def _offsets(numel: int, block_size: int) -> tuple[int, int]:
    """Byte offsets of the positions and of the codes."""
    blocks, values, ib = _sizes(numel, block_size)
    return _SCALE_BYTES * blocks, _SCALE_BYTES * blocks + ib * values


@torch.no_grad()
def encode(x: torch.Tensor, block_size: int = 256, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Encode the 1-D float32 ``x`` into a 1-D uint8 wire of :func:`wire_numel` bytes (see the module docstring)."""
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"x must be a 1-D float32 tensor, got {x.dtype} {tuple(x.shape)}")
    n = x.numel()
    nbytes = wire_numel(n, block_size)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if out.dtype != torch.uint8 or out.numel() != nbytes:
        raise ValueError(f"out must be a uint8 tensor of {nbytes} bytes, got {out.dtype} of {out.numel()}")
    ib = _index_bytes(block_size)
    pos_at, code_at = _offsets(n, block_size)
    value_at = 0
    for first, count, m in _runs(n, block_size):
        k = kept(m)
        rows = x[first * block_size : first * block_size + count * m].view(count, m)
        magnitude = rows.abs()
        _, idx = torch.topk(magnitude.nan_to_num_(nan=float("inf")), k, dim=1, sorted=False)
        del magnitude
        idx, _ = idx.sort(dim=1)  # positions in order: the same bytes whatever order topk returned them in
        vals = rows.gather(1, idx)
        scale = vals.abs().amax(dim=1, keepdim=True)
        # a NaN or an Inf ranks first (NaN as Inf), so it is kept and its block's scale is not finite
        bad = ~torch.isfinite(scale)
        scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
        safe = torch.where((scale > 0) & ~bad, scale, torch.ones_like(scale))
        q = torch.round(vals / safe * _LEVELS).clamp_(-_LEVELS, _LEVELS).to(torch.int16) + 8
        q = torch.where(bad | (scale == 0), torch.full_like(q, 8), q).to(torch.uint8)
        half = (k + 1) // 2
        lo, hi = q[:, :half], q[:, half:]
        packed = lo.clone()
        packed[:, : hi.shape[1]] |= hi << 4
        out[_SCALE_BYTES * first : _SCALE_BYTES * (first + count)].view(torch.uint8).copy_(
            scale.reshape(-1).contiguous().view(torch.uint8))
        positions = idx.to(torch.int32 if ib == 2 else torch.uint8)
        if ib == 2:
            positions = torch.stack([positions & 0xFF, positions >> 8], dim=2).to(torch.uint8)
        out[pos_at + ib * value_at : pos_at + ib * (value_at + count * k)].copy_(positions.reshape(-1))
        out[code_at : code_at + count * half].copy_(packed.reshape(-1))
        value_at += count * k
        code_at += count * half  # the codes of the next run follow this run's
    return out


@torch.no_grad()
def decode(wire: torch.Tensor, numel: int, block_size: int = 256, out: Optional[torch.Tensor] = None,
           accumulate: bool = False) -> torch.Tensor:
    """Decode ``numel`` float32 values from ``wire`` into ``out``, or add them to ``out`` with ``accumulate``
    (bit-identical to decoding into a temporary and adding it, but that a -0.0 where nothing was kept stays -0.0):
    only the kept places are touched, so decoding costs the kept values, not the block."""
    nbytes = wire_numel(numel, block_size)
    if wire.dtype != torch.uint8 or wire.numel() != nbytes:
        raise ValueError(f"wire must be a uint8 tensor of {nbytes} bytes for {numel} values, got {wire.dtype} of "
                         f"{wire.numel()}")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True adds to out: pass the out tensor")
        out = torch.empty(numel, dtype=torch.float32, device=wire.device)
    if out.dtype != torch.float32 or out.numel() != numel:
        raise ValueError(f"out must be a float32 tensor of {numel} elements, got {out.dtype} of {out.numel()}")
    ib = _index_bytes(block_size)
    pos_at, code_at = _offsets(numel, block_size)
    value_at = 0
    for first, count, m in _runs(numel, block_size):
        k = kept(m)
        half = (k + 1) // 2
        scale = wire[_SCALE_BYTES * first : _SCALE_BYTES * (first + count)].clone().view(torch.float32).view(count, 1)
        raw = wire[pos_at + ib * value_at : pos_at + ib * (value_at + count * k)].view(count, k, ib).to(torch.int64)
        idx = raw[:, :, 0] if ib == 1 else raw[:, :, 0] | (raw[:, :, 1] << 8)
        packed = wire[code_at : code_at + count * half].view(count, half)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=1)[:, :k].to(torch.float32) - 8
        vals = q * (scale / _LEVELS)
        rows = out[first * block_size : first * block_size + count * m].view(count, m)
        if not accumulate:
            rows.zero_()
        # only the kept places: adding the others' zeros would change nothing (but a -0.0 to +0.0)
        rows.scatter_add_(1, idx, vals)
        rows[~torch.isfinite(scale).view(-1)] = float("nan")
        value_at += count * k
        code_at += count * half
    return out


def error_bound(x: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    """Return a bound on ``|x - decode(encode(x))|`` per element: ``max(|x|, s / 14 * (1 + 2**-18))`` with ``s`` the
    block's largest magnitude (a dropped value decodes to 0, a kept one to within half a step); Inf in a block
    holding a NaN or an Inf.

    Example:
        >>> [round(v, 4) for v in error_bound(torch.tensor([1.0, 0.0]), 256).tolist()]
        [1.0, 0.0714]
    """
    _check(block_size)
    parts = []
    for first, count, m in _runs(x.numel(), block_size):
        rows = x[first * block_size : first * block_size + count * m].view(count, m)
        top = rows.abs().amax(dim=1, keepdim=True)
        bound = torch.maximum(rows.abs(), (top / (2 * _LEVELS)) * (1 + 2.0**-18))
        bound = bound.masked_fill(~torch.isfinite(rows).all(dim=1, keepdim=True), float("inf"))
        parts.append(bound.reshape(-1))
    return torch.cat(parts) if parts else x.new_empty(0)
