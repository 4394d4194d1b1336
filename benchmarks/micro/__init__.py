"""One piece at a time: the engine against DDP, collectives, the fused optimizer, data loading, load balancing, multistream TCP, autotuning."""

from __future__ import annotations

__all__: list[str] = []
