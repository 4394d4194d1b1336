"""Model parallelism beside data parallelism: expert-parallel mixture of experts (:mod:`.moe`)."""

from __future__ import annotations

__all__: list[str] = []
