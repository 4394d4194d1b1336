"""The cost of a ring allreduce, written once: what each rank sends, and in how many sequential steps.

A ring allreduce of ``S`` bytes over ``n`` ranks is a reduce-scatter then an all-gather, ``2 (n-1)`` steps of
``S / n`` bytes each, so every rank sends (and receives) ``2 (n-1) / n * S`` (Patarasuk and Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", 2009). The advisor, the cost model of
``benchmarks/`` and DiLoCo's byte counters all call these functions rather than write the formula again.

Example:
    >>> ring_allreduce_bytes(100.0, 4), ring_allreduce_steps(4)
    (150.0, 6)
"""

from __future__ import annotations

__all__ = ["ring_allreduce_bytes", "ring_allreduce_steps"]


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Return the bytes each of ``n`` ranks sends in a ring allreduce of ``nbytes``: ``2 (n-1) / n * nbytes``.

    One rank sends nothing (``0.0``). The same holds for any allreduce built of a reduce-scatter and an all-gather
    of equal chunks, e.g. ByteGrad's scatter-reduce-gather of an encoded buffer of ``nbytes``.

    Example:
        >>> ring_allreduce_bytes(10**8, 2), ring_allreduce_bytes(10**8, 1)
        (100000000.0, 0.0)
    """
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def ring_allreduce_steps(n: int) -> int:
    """Return the sequential message steps of a ring allreduce over ``n`` ranks: ``2 (n-1)`` (0 for one rank).

    Example:
        >>> ring_allreduce_steps(8)
        14
    """
    return 2 * (n - 1) if n > 1 else 0
