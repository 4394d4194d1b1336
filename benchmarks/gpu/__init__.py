"""Every CUDA path on a GPU machine (``benchmarks/gpu/gpu_check.sh OUT_DIR``) and the models' GPU step."""

from __future__ import annotations

__all__: list[str] = []
