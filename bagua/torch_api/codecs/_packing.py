"""Codes of ``bits`` bits packed ``8 // bits`` to a byte by parts of a block, and decoded at levels about each block's
``(centre, scale)`` header: the shared inner steps of the centred row codecs (``nf2``, ``sign1``).

Byte ``i`` of a block's codes holds the code of element ``i + j * h`` (``h`` the block's code bytes) in bits
``bits * j`` to ``bits * (j + 1) - 1``, 0 past the end.
"""

from __future__ import annotations

from typing import Sequence

import torch

from bagua.torch_api.codecs._constants import constant

__all__ = ["pack_codes", "decode_levels"]


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return constant(tuple(range(0, 8, bits)), torch.uint8, device, (1, 8 // bits, 1))


def pack_codes(q: torch.Tensor, codes: torch.Tensor, bits: int) -> None:
    """Pack the ``(k, (8 // bits) * h)`` uint8 codes ``q`` (written over) into the ``(k, h)`` uint8 ``codes``."""
    k = q.shape[0]
    parts = q.view(k, 8 // bits, -1)
    torch.bitwise_left_shift(parts, _shifts(bits, q.device), out=parts)
    codes.copy_(parts.sum(dim=1, dtype=torch.uint8))  # the parts' bits do not overlap: the sum is their OR


def decode_levels(codes: torch.Tensor, header: torch.Tensor, out: torch.Tensor, levels: Sequence[float], bits: int,
                  accumulate: bool) -> None:
    """Write ``centre + scale * levels[q]`` of the packed ``codes`` into the ``(k, m)`` float32 ``out`` (one product
    and one sum in float32), or add it with ``accumulate``; ``header`` holds each row's ``(centre, scale)``."""
    k, m = out.shape
    mask = (1 << bits) - 1
    q = torch.bitwise_right_shift(codes.unsqueeze(1), _shifts(bits, codes.device)).bitwise_and_(mask)
    values = constant(tuple(levels), torch.float32, codes.device, (len(levels),))[q.view(k, -1)[:, :m].long()]
    values.mul_(header[:, 1:2]).add_(header[:, 0:1])
    if accumulate:
        out.add_(values)
    else:
        out.copy_(values)
