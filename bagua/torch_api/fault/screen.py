"""One bad worker cannot stop or swamp a round: bound the samples it claims, leave out a contribution that is not
finite or far too large.

Both rules are pure functions of what every member of a round holds alike (the quorum's records, and the norms
all-gathered from the members), so every member takes the same decision and computes the same average:

- **samples** (:func:`bound_samples`): a member's weight is at most ``max_sample_ratio`` (default 8) times the
  median of the *other* sources' samples (a worker that claims 1e9 samples against peers' 1000 weighs 8000); with
  one source alone, nothing is bounded. A negative claim counts as 0.
- **contributions** (:func:`screen`): a source whose tensor holds NaN or Inf (its norm is not finite) is left out;
  with 3 or more finite sources, so is one whose L2 norm exceeds ``max_norm_ratio`` (default 10) times the median
  of their norms (when that median is above 0). The others' average is rescaled to the members kept.

The norms travel either by an all-gather of their own (:func:`gather_norms`) or on the average itself
(:func:`slotted_average`: a slot per member appended to the buffer, so one allreduce carries the contributions and
every norm; only when the screen leaves a member out is the average run again, without it).

The norms are what each member reports of its own tensor: the rules catch faults (a diverged worker, a corrupted
tensor, a bug), not a worker that lies about its norm (see docs/fault_tolerance.md, the threat model).

Example:
    >>> bound_samples([1000, 1000, 10**9], max_ratio=8.0)
    [1000, 1000, 8000]
    >>> screen([1.0, 1.2, float("nan"), 1e6], [1, 1, 1, 1], max_ratio=10.0)
    ([1, 1, 0, 0], {2: 'its contribution holds NaN or Inf', 3: 'its norm 1e+06 is 8.3e+05x the median 1.2 of the round (limit 10x)'})
"""

from __future__ import annotations

import datetime
import math
import statistics
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["MAX_NORM_RATIO", "MAX_SAMPLE_RATIO", "bound_samples", "screen", "gather_norms", "kept_average",
           "slotted_average"]

#: a contribution larger than this many times the median norm of the round's sources is left out (3+ sources)
MAX_NORM_RATIO = 10.0
#: a member's samples count at most this many times the median of the other sources'
MAX_SAMPLE_RATIO = 8.0
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def bound_samples(samples: Sequence[int], max_ratio: Optional[float] = MAX_SAMPLE_RATIO) -> list[int]:
    """Each source's ``samples`` (0: not a source) bounded by ``max_ratio`` times the median of the other
    sources'; ``None``: only negative claims are bounded (to 0)."""
    claimed = [max(0, int(s)) for s in samples]
    if max_ratio is None:
        return claimed
    out = []
    for i, s in enumerate(claimed):
        others = [o for j, o in enumerate(claimed) if j != i and o > 0]
        out.append(min(s, int(max_ratio * statistics.median(others))) if s and others else s)
    return out


def screen(norms: Sequence[float], weights: Sequence[int], max_ratio: Optional[float] = MAX_NORM_RATIO
           ) -> tuple[list[int], dict[int, str]]:
    """The ``weights`` with the members left out set to 0, and why each was (by member index).

    Only sources (weight above 0) are judged: a non-finite norm is left out; at 3 or more finite sources, a norm
    above ``max_ratio`` times their median (above 0) too; ``max_ratio=None`` keeps every finite one.
    """
    kept, why = list(weights), {}
    for i, (n, w) in enumerate(zip(norms, weights)):
        if w and not math.isfinite(n):
            kept[i], why[i] = 0, "its contribution holds NaN or Inf"
    finite = [n for n, w in zip(norms, kept) if w]
    if max_ratio is not None and len(finite) >= 3:
        median = statistics.median(finite)
        for i, (n, w) in enumerate(zip(norms, kept)):
            if w and median > 0 and n > max_ratio * median:
                kept[i], why[i] = 0, (f"its norm {n:.2g} is {n / median:.2g}x the median {median:.2g} of the round "
                                      f"(limit {max_ratio:g}x)")
    return kept, why


def gather_norms(group: Any, tensor: torch.Tensor, size: int, timeout_s: float) -> list[float]:
    """The L2 norm of every member's ``tensor`` (accumulated in float64), all-gathered on the round's gloo
    ``group`` of ``size`` members, in member order."""
    mine = torch.linalg.vector_norm(tensor.detach().reshape(-1), dtype=torch.float64).reshape(1).cpu()
    out = [torch.empty_like(mine) for _ in range(size)]
    group.allgather([out], [mine]).wait(datetime.timedelta(seconds=timeout_s))
    return [float(t.item()) for t in out]


def kept_average(group: Any, buf: torch.Tensor, rank: int, weights: Sequence[int], timeout: datetime.timedelta) -> None:
    """Average ``buf`` in place over the members whose ``weights`` (after :func:`screen`) are above 0, on the round's
    gloo ``group`` (this member at ``rank``): a plain mean when the kept weigh the same, else weighted; a member
    left out sends zeros (not a product with 0: NaN * 0 is NaN). Every member takes the same branch."""
    kept = [w for w in weights if w]
    if weights[rank] == 0:
        buf.zero_()
    elif not all(w == kept[0] for w in kept):
        buf.mul_(weights[rank] / sum(kept))
    group.allreduce([buf]).wait(timeout)
    if kept and all(w == kept[0] for w in kept):
        buf.div_(len(kept))


def slotted_average(group: Any, buf: torch.Tensor, rank: int, weights: Sequence[int], max_ratio: Optional[float],
                    timeout: datetime.timedelta, refill: Callable[[torch.Tensor], None]
                    ) -> tuple[list[int], dict[int, str]]:
    """Average ``buf[:-n]`` (this member's contribution; ``n = len(weights)`` members) in place over the members
    that :func:`screen` keeps, on the round's gloo ``group``; return the kept weights and why each other was left
    out.

    The last ``n`` values of ``buf`` are slots: this member writes the L2 norm of its contribution (accumulated in
    float64, stored in float32, a finite one at most float32's largest) in slot ``rank`` and zeros in the others, so
    that one allreduce carries the contributions and every member's norm (a sum with zeros: each norm arrives
    exact). When every member is kept, that is the average: a plain mean (sum, then divided) when the members weigh
    the same, else each contribution scaled by its weight's share before the sum, as :func:`kept_average`. When
    the screen leaves members out, ``refill(buf[:-n])`` writes this member's contribution again and
    :func:`kept_average` runs without them (every member takes the same branch).
    """
    n = len(weights)
    data, slots = buf[:-n], buf[-n:]
    norm = float(torch.linalg.vector_norm(data, dtype=torch.float64))
    slots.zero_()
    slots[rank] = min(norm, _FLOAT32_MAX) if math.isfinite(norm) else norm
    equal = all(w == weights[0] for w in weights)
    if not equal:
        data.mul_(weights[rank] / max(1, sum(weights)))
    group.allreduce([buf]).wait(timeout)
    kept, why = screen(slots.tolist(), weights, max_ratio)
    if kept == list(weights):
        if equal:
            data.div_(n)
        return kept, why
    refill(data)
    kept_average(group, data, rank, kept, timeout)
    return kept, why
