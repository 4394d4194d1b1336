"""``nf2``: 2-bit codes at the Lloyd-Max levels of a normal distribution, scaled per block by its mean and RMS.

Min/max codes waste 2 bits: a block's extremes set the step, so most of a pseudo-gradient (heavy-tailed: most
values far inside the range) lands on the two middle levels, and on the GPT's pseudo-gradients ``uint4``'s min/max
formula at 2 bits leaves a larger error than sending nothing. ``nf2`` centres and scales each block by its mean
``mu`` and root mean square ``rms`` (float32, the reductions in float64) and codes it at the 4 levels that minimize
a normal distribution's squared error (Lloyd-Max: ``+-0.4528``, ``+-1.5104``; thresholds ``0``, ``+-0.9816``)::

    c = x - mu,  t = 0.9816 * rms                      (float32)
    q = [c > -t] + [c > 0] + [c > t]                   (0..3)
    x' = mu + rms * LEVELS[q]                          (float32: one product, one sum)

Per element ``|x - x'| <= rms * max(0.5288, |x - mu| / rms - 1.5104)`` plus float32 rounding: at most 0.53 rms
within 2 rms of the mean (:func:`error_bound_rows`). A constant block (``rms = 0``) decodes to itself; a block
holding a NaN or an Inf decodes to NaN or Inf everywhere (its mean or RMS is not finite), which callers detect,
and so may a finite block whose ``1.5104 rms`` passes float32's largest value (values near ``2**127``).
Unlike the min/max codes the error is not bounded by the block's range: outliers are clipped to ``1.51 rms`` and
error feedback carries the rest to the next round.

Layout (by :mod:`~bagua.torch_api.codecs.block`, which owns the wire): a block's float32 header ``(mu, rms)``, and
its codes four to a byte, by quarters: byte ``i`` of a block of ``m`` elements holds the codes of elements ``i + j *
ceil(m / 4)`` in bits ``2j`` and ``2j + 1`` (``j = 0..3``; 0 past the end). At a block of 256, 2.25 bits per value.

Example:
    >>> rows = torch.tensor([[-3.0, -1.0, 1.0, 3.0]])          # mean 0, RMS 5 ** 0.5
    >>> header, codes = torch.empty(1, 2), torch.empty(1, 1, dtype=torch.uint8)
    >>> encode_rows(rows, header, codes)
    >>> codes.item() == 0 + (1 << 2) + (2 << 4) + (3 << 6)           # codes 0, 1, 2, 3 in one byte
    True
    >>> decoded = torch.empty(1, 4)
    >>> decode_rows(codes, header, decoded)
    >>> [round(v, 2) for v in decoded.view(-1).tolist()]            # 5 ** 0.5 * (-1.5104, -0.4528, ...)
    [-3.38, -1.01, 1.01, 3.38]
"""

from __future__ import annotations

import torch

from bagua.torch_api.codecs._packing import decode_levels, pack_codes

__all__ = ["LEVELS", "THRESHOLD", "code_bytes", "encode_rows", "decode_rows", "error_bound_rows"]

#: The Lloyd-Max 2-bit levels of a standard normal distribution, in code order.
LEVELS = (-1.5104, -0.4528, 0.4528, 1.5104)
#: The outer decision threshold (the middle one is 0).
THRESHOLD = 0.9816
_WORST_INNER = max(LEVELS[2], THRESHOLD - LEVELS[2])  # 0.5288: the largest error of a value within the thresholds


def code_bytes(m: int) -> int:
    """Bytes of codes for a block of ``m`` elements: ``ceil(m / 4)``."""
    return -(-m // 4)


def _stats(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's float32 mean and RMS about it, reduced in float64."""
    wide = rows.double()
    mu = wide.mean(dim=1, keepdim=True).float()
    rms = (wide - mu.double()).square_().mean(dim=1, keepdim=True).sqrt_().float()
    return mu, rms


def encode_rows(rows: torch.Tensor, header: torch.Tensor, codes: torch.Tensor) -> None:
    """Write the ``(mu, rms)`` of each of the ``(k, m)`` float32 ``rows`` into ``header`` (``(k, 2)`` float32) and
    their codes into ``codes`` (``(k, ceil(m / 4))`` uint8)."""
    k, m = rows.shape
    mu, rms = _stats(rows)
    header[:, 0:1] = mu
    header[:, 1:2] = rms
    c = rows - mu
    t = rms * THRESHOLD
    h = code_bytes(m)
    q = torch.zeros(k, 4 * h, dtype=torch.uint8, device=rows.device)
    q[:, :m] = (c > -t).to(torch.uint8)
    q[:, :m] += c > 0
    q[:, :m] += c > t
    pack_codes(q, codes, 2)


def decode_rows(codes: torch.Tensor, header: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """Write ``mu + rms * LEVELS[q]`` of the ``(k, ceil(m / 4))`` uint8 ``codes`` into the ``(k, m)`` float32
    ``out``, or add it (in float32) with ``accumulate``."""
    decode_levels(codes, header, out, LEVELS, 2, accumulate)


def error_bound_rows(rows: torch.Tensor) -> torch.Tensor:
    """The bound of the module docstring on ``|x - x'|`` for each element of the ``(k, m)`` float32 ``rows``:
    ``rms * max(0.5288, |x - mu| / rms - 1.5104)`` plus ``2**-19 (|x| + |mu| + 2 rms)`` for float32 rounding
    (float64, Inf in blocks that are not finite)."""
    mu, rms = (s.double() for s in _stats(rows))
    dev = (rows.double() - mu).abs()
    inner = rms * _WORST_INNER
    bound = torch.maximum(inner.expand_as(dev), dev - rms * LEVELS[3]) * (1 + 2.0**-20)
    bound += 2.0**-19 * (rows.double().abs() + mu.abs() + 2 * rms)
    finite = torch.isfinite(mu) & torch.isfinite(rms)
    return bound.masked_fill_(~finite.expand_as(bound), float("inf"))
