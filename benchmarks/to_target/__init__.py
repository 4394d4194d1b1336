"""Time to accuracy: the planner, the runner, the table, and the campaigns built on them."""

from __future__ import annotations

__all__: list[str] = []
