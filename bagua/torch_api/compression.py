"""MinMaxUInt8: the 8-bit codec of ByteGrad, QAdam and low-precision decentralized SGD, as pure tensor functions.

Per chunk, with ``eps = 1e-7``::

    scale = 255 / (max - min + eps);  upper = round(max * scale);  lower = upper - 255
    encode: q = uint8(min(round(x * scale), upper) - lower)
    decode: x' = (q + lower) / scale

so ``|x - x'| <= (max - min + eps) / 510`` (half a quantization step). The wire format of ``n`` chunks of ``L``
elements is one ``uint8`` tensor of shape ``(n, 8 + L)``: each row starts with the chunk's min and max as two
float32 (8 bytes), followed by its ``L`` codes, so a whole bucket travels in a single collective.

Example:
    >>> x = torch.randn(2, 1000)
    >>> wire = torch.empty(2, 8 + 1000, dtype=torch.uint8)
    >>> encode_chunks(x, wire)
    >>> y = torch.empty_like(x); decode_chunks(wire, y)
    >>> bool(((x - y).abs() <= (x.amax(1, True) - x.amin(1, True)) / 510 + 1e-6).all())
    True
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["EPS", "HEADER_BYTES", "wire_buffer", "encode_chunks", "decode_chunks", "quantization_error_bound"]

EPS = 1e-7
HEADER_BYTES = 8


def wire_buffer(n_chunks: int, chunk_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Allocate the ``(n_chunks, 8 + chunk_len)`` uint8 wire buffer."""
    return torch.empty(n_chunks, HEADER_BYTES + chunk_len, dtype=torch.uint8, device=device)


def _scale_lower(minmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk ``scale`` and ``lower`` (shape ``(n, 1)``, float32) from ``(n, 2)`` min/max."""
    mn, mx = minmax[:, 0:1], minmax[:, 1:2]
    scale = 255.0 / (mx - mn + EPS)
    upper = torch.round(mx * scale)
    return scale, upper - 255.0


def encode_chunks(x: torch.Tensor, wire: torch.Tensor, work: Optional[torch.Tensor] = None) -> None:
    """Encode the rows of ``x`` (``(n, L)``, float) into ``wire`` (``(n, 8 + L)``, uint8).

    Args:
        x: the chunks, one per row (any float dtype; computed in float32).
        wire: output buffer from :func:`wire_buffer`.
        work: optional float32 ``(n, L)`` scratch buffer, to avoid an allocation per call.
    """
    n, length = x.shape
    xf = x if x.dtype == torch.float32 else x.float()
    minmax = torch.stack([xf.amin(dim=1), xf.amax(dim=1)], dim=1)
    wire[:, :HEADER_BYTES].copy_(minmax.contiguous().view(torch.uint8).view(n, HEADER_BYTES))
    scale, lower = _scale_lower(minmax)
    if work is None:
        work = torch.empty(n, length, dtype=torch.float32, device=x.device)
    torch.mul(xf, scale, out=work)
    work.round_()
    torch.minimum(work, lower + 255.0, out=work)
    work.sub_(lower).clamp_(0.0, 255.0)
    wire[:, HEADER_BYTES:].copy_(work)


def decode_chunks(wire: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """Decode ``wire`` (``(n, 8 + L)``) into ``out`` (``(n, L)``); with ``accumulate``, add to ``out`` instead."""
    n = wire.shape[0]
    minmax = wire[:, :HEADER_BYTES].contiguous().view(torch.float32).view(n, 2)
    scale, lower = _scale_lower(minmax)
    codes = wire[:, HEADER_BYTES:]
    if accumulate:
        out.add_((codes.float() + lower) / scale)
    else:
        out.copy_(codes)
        out.add_(lower).div_(scale)


def quantization_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Largest decode error of each row of ``x``: half a quantization step, ``(max - min + eps) / 510``."""
    xf = x.float()
    return (xf.amax(dim=1) - xf.amin(dim=1) + EPS) / 510.0
