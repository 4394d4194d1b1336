"""Small constant tensors (shift tables, code levels) made once per device and reused by the codecs."""

from __future__ import annotations

import torch

_CONSTANTS: dict[tuple, torch.Tensor] = {}


def constant(values: tuple, dtype: torch.dtype, device: torch.device, shape: tuple) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device).view(shape)``, made once per (values, dtype, device, shape)
    and not to be written to.

    Example:
        >>> constant((0, 4), torch.uint8, torch.device("cpu"), (1, 2, 1)).shape
        torch.Size([1, 2, 1])
    """
    key = (values, dtype, device, shape)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=device).view(shape)
    return _CONSTANTS[key]
