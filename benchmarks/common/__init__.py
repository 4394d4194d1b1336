"""The emulated-network suite's machinery: test hosts, the job each host runs, the models, the report."""

from __future__ import annotations

__all__: list[str] = []
