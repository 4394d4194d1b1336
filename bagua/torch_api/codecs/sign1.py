"""``sign1``: 1 bit per value, each value's side of its block's mean, scaled by the block's mean absolute deviation.

The scaled-sign code of signSGD with error feedback and 1-bit Adam, centred per block. A block of ``m`` float32
values keeps its mean ``mu`` and ``s``, the mean of ``|x - mu|`` (both float32, the reductions in float64), and one
bit per value::

    c  = x - mu                                    (float32)
    q  = [c > 0]                                   (0 or 1)
    x' = mu + s * (2 q - 1)                        (float32: one product, exact, and one sum)

For a fixed block and its bits, ``s`` is the scale that minimizes the squared error (the least-squares fit of
``s * sign(c)`` to ``c``), whatever the distribution; for a normal one it is 0.80 of the RMS, the 1-bit Lloyd-Max
level. The error of an element is exactly ``| |c| - s |`` before float32 rounding (:func:`error_bound_rows`):
large deviations are clipped to ``s``, and error feedback carries the rest to the next round. A constant block
(``s = 0``) decodes to itself; a block holding a NaN or an Inf decodes to NaN or Inf everywhere.

Layout (by :mod:`~bagua.torch_api.codecs.block`, which owns the wire): a block's float32 header ``(mu, s)``, then
its bits eight to a byte by eighths: bit ``j`` of byte ``i`` of a block of ``m`` elements is the code of element
``i + j * ceil(m / 8)`` (0 past the end). At a block of 256, 1.25 bits per value (``nf2``: 2.25).

Example:
    >>> rows = torch.tensor([[-3.0, -1.0, 1.0, 3.0]])          # mean 0, mean |x - mu| 2
    >>> header, codes = torch.empty(1, 2), torch.empty(1, 1, dtype=torch.uint8)
    >>> encode_rows(rows, header, codes)
    >>> codes.item() == (1 << 2) + (1 << 3)                      # elements 2 and 3 lie above the mean
    True
    >>> decoded = torch.empty(1, 4)
    >>> decode_rows(codes, header, decoded)
    >>> decoded.view(-1).tolist()
    [-2.0, -2.0, 2.0, 2.0]
"""

from __future__ import annotations

import torch

from bagua.torch_api.codecs._packing import decode_levels, pack_codes

__all__ = ["code_bytes", "encode_rows", "decode_rows", "error_bound_rows"]

_LEVELS = (-1.0, 1.0)


def code_bytes(m: int) -> int:
    """Bytes of codes for a block of ``m`` elements: ``ceil(m / 8)``."""
    return -(-m // 8)


def _stats(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's float32 mean and mean absolute deviation about it, reduced in float64."""
    wide = rows.double()
    mu = wide.mean(dim=1, keepdim=True).float()
    s = (wide - mu.double()).abs_().mean(dim=1, keepdim=True).float()
    return mu, s


def encode_rows(rows: torch.Tensor, header: torch.Tensor, codes: torch.Tensor) -> None:
    """Write the ``(mu, s)`` of each of the ``(k, m)`` float32 ``rows`` into ``header`` (``(k, 2)`` float32) and
    their bits into ``codes`` (``(k, ceil(m / 8))`` uint8)."""
    k, m = rows.shape
    mu, s = _stats(rows)
    header[:, 0:1] = mu
    header[:, 1:2] = s
    h = code_bytes(m)
    q = torch.zeros(k, 8 * h, dtype=torch.uint8, device=rows.device)
    q[:, :m] = (rows - mu) > 0
    pack_codes(q, codes, 1)


def decode_rows(codes: torch.Tensor, header: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """Write ``mu + s * (2 q - 1)`` of the ``(k, ceil(m / 8))`` uint8 ``codes`` into the ``(k, m)`` float32 ``out``,
    or add it (in float32) with ``accumulate``."""
    decode_levels(codes, header, out, _LEVELS, 1, accumulate)


def error_bound_rows(rows: torch.Tensor) -> torch.Tensor:
    """The bound on ``|x - x'|`` for each element of the ``(k, m)`` float32 ``rows``: ``| |x - mu| - s |`` plus
    ``2**-19 (|x| + |mu| + s)`` for float32 rounding (float64, Inf in blocks that are not finite)."""
    mu, s = (t.double() for t in _stats(rows))
    dev = (rows.double() - mu).abs()
    bound = (dev - s).abs_() * (1 + 2.0**-20)
    bound += 2.0**-19 * (rows.double().abs() + mu.abs() + s)
    finite = torch.isfinite(mu) & torch.isfinite(s)
    return bound.masked_fill_(~finite.expand_as(bound), float("inf"))
