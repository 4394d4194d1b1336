"""Workers that fail alone: kills, heals and restarts."""

from __future__ import annotations

__all__: list[str] = []
