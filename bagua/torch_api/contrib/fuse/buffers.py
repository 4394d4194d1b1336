"""Allocation of the fused optimizer's flat buffers.

Owned flat buffers of at least :data:`HUGE_PAGES_MIN_BYTES` on CPU are allocated by :func:`flat_buffer` on
transparent huge pages where Linux allows it: a fused step streams every buffer once per step, and with 4 KiB pages
that costs a TLB miss per 4 KiB of every stream.

Part of :mod:`bagua.torch_api.contrib.fuse.layout`, which re-exports these names.
"""

from __future__ import annotations

import mmap
import os

import torch

__all__ = ["flat_buffer", "huge_pages_enabled", "HUGE_PAGES_MIN_BYTES"]

HUGE_PAGES_MIN_BYTES = 4 << 20  # smaller buffers gain little and would waste up to a 2 MiB page each
_HUGE_PAGE = 2 << 20
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
_thp_mode: str | None = None


def huge_pages_enabled() -> bool:
    """Return whether :func:`flat_buffer` puts large CPU buffers on transparent huge pages.

    True on Linux when the kernel's THP mode is ``always`` or ``madvise`` and the environment variable
    ``BAGUA_FUSE_HUGE_PAGES`` is not ``0`` (read at every call, so it can be switched off at run time).
    """
    global _thp_mode
    if os.environ.get("BAGUA_FUSE_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    if _thp_mode is None:
        try:
            with open(_THP_ENABLED) as f:
                text = f.read()
            _thp_mode = text[text.index("[") + 1 : text.index("]")]
        except (OSError, ValueError):
            _thp_mode = "never"
    return _thp_mode in ("always", "madvise")


def flat_buffer(numel: int, dtype: torch.dtype, device: torch.device, zero: bool = True) -> torch.Tensor:
    """Return a new 1-D buffer of ``numel`` elements (zeros when ``zero``; with huge pages always zeros).

    On CPU, a buffer of at least :data:`HUGE_PAGES_MIN_BYTES` is an anonymous private mapping advised
    ``MADV_HUGEPAGE`` before its first touch, starting on a 2 MiB boundary, when :func:`huge_pages_enabled`. The
    tensor keeps the mapping alive; it is unmapped with the last tensor that uses it. Its storage cannot be
    resized. Elsewhere, or when the mapping fails, it is ``torch.zeros`` / ``torch.empty``.
    """
    device = torch.device(device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = numel * itemsize
    if device.type == "cpu" and nbytes >= HUGE_PAGES_MIN_BYTES and huge_pages_enabled():
        try:
            region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            region.madvise(mmap.MADV_HUGEPAGE)
            raw = torch.frombuffer(region, dtype=torch.uint8)
            start = -raw.data_ptr() % _HUGE_PAGE
            return raw[start : start + nbytes].view(dtype)
        except (OSError, ValueError, RuntimeError, AttributeError):
            pass  # no mmap/madvise here: an ordinary allocation
    return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
