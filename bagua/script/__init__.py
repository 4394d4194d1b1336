"""The original Bagua's script modules; ``python -m bagua.script.baguarun`` runs the ``baguarun`` launcher."""

from __future__ import annotations

__all__: list[str] = []
