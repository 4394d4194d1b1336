"""The codecs' speed, their Triton kernels, and where a ByteGrad step's time goes."""

from __future__ import annotations

__all__: list[str] = []
