"""The original Bagua's path of the ``baguarun`` script: ``python -m bagua.script.baguarun``.

The launcher itself is :mod:`bagua.distributed.baguarun` (the ``baguarun`` console script); this module only
re-exports its entry point.

Example::

    python -m bagua.script.baguarun --host_list h1,h2 --nproc_per_node=2 train.py
"""

from __future__ import annotations

from bagua.distributed.baguarun import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
