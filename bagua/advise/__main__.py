"""``python -m bagua.advise``: see :mod:`bagua.advise.cli`."""

from __future__ import annotations

import sys

from bagua.advise.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
