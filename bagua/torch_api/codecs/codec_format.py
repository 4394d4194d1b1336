"""The wire format of the 8-bit MinMaxUInt8 codec (:mod:`bagua.torch_api.codecs.minmax_uint8`): the wire buffer, the
per-chunk parameters derived from a chunk's min and max, and the error bound.

A wire of ``n`` chunks of ``L`` elements is one ``uint8`` tensor of shape ``(n, 8 + L)``: each row starts with the
chunk's min and max as two float32 (:data:`HEADER_BYTES`), followed by its ``L`` codes.

Example:
    >>> wire = wire_buffer(2, 10); wire.shape
    torch.Size([2, 18])
    >>> p = ChunkParams(torch.tensor([[0.0, 1.0], [-1.0, 1.0]])); [round(s, 1) for s in p.scales]
    [255.0, 127.5]
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "EPS",
    "HEADER_BYTES",
    "ChunkParams",
    "wire_buffer",
    "quantization_error_bound",
]

EPS = 1e-7
HEADER_BYTES = 8


def wire_buffer(n_chunks: int, chunk_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Allocate the ``(n_chunks, 8 + chunk_len)`` uint8 wire buffer.

    Example:
        >>> wire_buffer(4, 10).shape
        torch.Size([4, 18])
    """
    return torch.empty(n_chunks, HEADER_BYTES + chunk_len, dtype=torch.uint8, device=device)


def _scale_lower(minmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk ``scale`` and ``lower`` (shape ``(n, 1)``, float32) from ``(n, 2)`` float32 min/max."""
    mn, mx = minmax[:, 0:1], minmax[:, 1:2]
    scale = 255.0 / (mx - mn + EPS)
    upper = torch.round(mx * scale)
    return scale, upper - 255.0


_MAGIC = float(1 << 23)


def _unclamped_rows(minmax: torch.Tensor, scale: torch.Tensor, lower: torch.Tensor) -> list[bool]:
    """For each row, whether ``round(x*scale) - lower`` is sure to lie in ``[0, 255]`` for every ``x`` of the row
    and to stay exact when ``2**23`` is added, so that the encoder may skip its clamp and its int32 cast.

    Float32 multiplication by ``scale > 0`` and rounding are monotonic, so every ``round(x*scale)`` lies between
    ``round(min*scale)`` and ``round(max*scale) = upper = lower + 255``; only the lower end needs checking (the
    float32 rounding of ``min*scale`` can fall one step below ``lower`` when the range is large). A NaN or Inf
    min/max fails the test, and such rows take the general path.
    """
    lowest = torch.round(minmax[:, 0:1] * scale)
    ok = (lowest >= lower) & (lower.abs() < _MAGIC / 2) & (lowest.abs() < _MAGIC / 2) & (scale > 0)
    return ok.view(-1).tolist()


def _header(wire: torch.Tensor) -> torch.Tensor:
    """The ``(n, 2)`` float32 min/max stored at the start of every row of ``wire``."""
    n = wire.shape[0]
    return wire[:, :HEADER_BYTES].reshape(-1).view(torch.float32).view(n, 2)


class ChunkParams:
    """The per-chunk codec parameters, derived once from the ``(n, 2)`` float32 min/max of ``n`` chunks.

    A chunk sent in several segments uses the same parameters for every segment; preparing them once (instead of
    at every call) saves about 0.1-0.2 ms of small tensor operations per segment on CPU.

    Args:
        minmax: the ``(n, 2)`` min and max of each chunk (``compression.chunk_minmax``), or of the chunks a wire
            holds (:meth:`of_wire`).

    Example:
        >>> from bagua.torch_api.codecs.minmax_uint8 import chunk_minmax, encode_chunks
        >>> x = torch.randn(2, 1000)
        >>> p = ChunkParams(chunk_minmax(x))
        >>> wire = wire_buffer(2, 500)
        >>> encode_chunks(x[:, :500], wire, params=p)  # the first segment of both chunks
    """

    __slots__ = ("_fast", "header", "lower", "lowers", "minmax", "scale", "scales")

    def __init__(self, minmax: torch.Tensor) -> None:
        # plus 0: a zero min or max as +0 (the sign a reduction keeps depends on its order, so on the device)
        self.minmax = (minmax.detach().float() + 0.0).contiguous()
        self.header = self.minmax.view(torch.uint8)
        self.scale, self.lower = _scale_lower(self.minmax)
        self.scales: list[float] = self.scale.view(-1).tolist()
        self.lowers: list[float] = self.lower.view(-1).tolist()
        self._fast: Optional[list[bool]] = None

    @classmethod
    def of_wire(cls, wire: torch.Tensor) -> "ChunkParams":
        """The parameters of the chunks encoded in ``wire`` (read from its headers)."""
        return cls(_header(wire))

    def decodes_finite(self) -> bool:
        """Whether every value these chunks decode to is finite, without reading the codes.

        A decoded value is ``(q + lower) / scale`` with ``0 <= q <= 255``, monotonic in ``q`` (float32 rounding
        keeps it so), so the values of ``q = 0`` and ``q = 255`` bound every other: the answer is exact for the 256
        codes. ``False`` may still come with finite data when only a code that no element uses overflows (a range
        next to the float32 limits): check the values themselves then.

        Example:
            >>> ChunkParams(torch.tensor([[-1.0, 1.0]])).decodes_finite()
            True
            >>> ChunkParams(torch.tensor([[-1.0, float("nan")]])).decodes_finite()
            False
        """
        ends = torch.cat((self.lower / self.scale, (self.lower + 255.0) / self.scale), dim=1)
        return bool(torch.isfinite(ends).all())

    @property
    def fast(self) -> list[bool]:
        """Per chunk, whether the encoder may skip its clamp (see :func:`_unclamped_rows`)."""
        if self._fast is None:
            self._fast = _unclamped_rows(self.minmax, self.scale, self.lower)
        return self._fast


def _check_wire(wire: torch.Tensor, n: int, length: int) -> None:
    if wire.dtype != torch.uint8 or tuple(wire.shape) != (n, HEADER_BYTES + length):
        raise ValueError(
            f"wire must be a uint8 tensor of shape ({n}, {HEADER_BYTES + length}) for {n} chunks of {length} "
            f"elements (see wire_buffer), got {wire.dtype} {tuple(wire.shape)}"
        )


def quantization_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Largest decode error of each row of ``x``: half a quantization step, ``(max - min + eps) / 510``.

    Example:
        >>> quantization_error_bound(torch.tensor([[0.0, 5.1]]))
        tensor([0.0100])
    """
    xf = x.float()
    return (xf.amax(dim=1) - xf.amin(dim=1) + EPS) / 510.0
