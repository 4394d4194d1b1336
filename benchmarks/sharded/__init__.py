"""Sharded replicas: islands of fast links joined by a slow one, and the memory Bagua adds."""

from __future__ import annotations

__all__: list[str] = []
