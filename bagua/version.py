"""Bagua's version: the one place it is written (``bagua.__version__`` and pyproject.toml read it here).

Also the original Bagua's import path, ``from bagua.version import __version__``.

Example:
    >>> from bagua.version import __version__
    >>> import bagua
    >>> bagua.__version__ == __version__
    True
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "1.0.0.dev0"
