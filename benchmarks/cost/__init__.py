"""The step-time cost model, its calibration, the paper's scale and the GPU mapping column."""

from __future__ import annotations

__all__: list[str] = []
