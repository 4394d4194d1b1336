"""DiLoCo's pace: how many inner steps each worker takes per round, and how long a round is.

Two rules, both pure functions of a small table every worker gathers at each exchange (so every worker takes the
same decision, with no leader):

- :func:`plan_steps` (``rounds="time"``): rounds by time. The fastest worker takes ``H`` inner steps, worker ``i``
  ``max(min_steps, round(H * t_fastest / t_i))`` (``t``: its compute seconds per inner step), so every worker
  reaches the exchange at about the same moment; a worker within ``speed_tolerance`` of the fastest takes ``H``
  (equal workers: today's DiLoCo, bit for bit).
- :func:`link_sync_every` (``sync_every_max``): links that change. When the round's exchange takes more than
  ``max_exchange_share`` of the round's compute, ``H`` rises (to aim at 0.8 of the share); when it takes less
  than half the share, ``H`` falls back towards ``sync_every`` (same aim). The band between is the hysteresis.

:class:`Pace` holds one worker's round: its position, its ``H``, its samples per fragment and its timings;
:class:`~bagua.torch_api.ops.diloco_driver.DiLoCoDriver` calls it at the moments of a step. A report row is
``[tokens, seconds per step, inner steps, wait s, exchange s]`` (:data:`ROW`); the last two are the worker's
previous round's (known only once that round's exchange is over).

Example:
    >>> plan_steps([0.1, 0.1, 0.3], 12, 0.1)
    [12, 12, 4]
    >>> link_sync_every(10, exchange_s=0.2, seconds_per_step=0.1, low=10, high=100, share=0.1)
    25
"""

from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import torch

from bagua.torch_api.ops.diloco import sync_offsets

__all__ = ["ROUNDS", "ROW", "plan_steps", "link_sync_every", "Pace"]

#: how a round ends: after ``sync_every`` inner steps on every worker, or by time (steps follow speed)
ROUNDS = ("steps", "time")
#: the columns of a report row
ROW = ("tokens", "seconds_per_step", "steps", "wait_s", "exchange_s")
#: the link rule aims at this fraction of ``max_exchange_share`` when it moves ``H``
AIM = 0.8
#: ... and lowers ``H`` only when the exchange takes less than this fraction of the share
LOWER = 0.5


def plan_steps(seconds_per_step: Sequence[float], sync_every: int, tolerance: float,
               min_steps: int = 1) -> list[int]:
    """The inner steps of each worker next round: ``sync_every`` for the fastest (and for any within
    ``tolerance`` of it, or not measured yet: ``t <= 0``), ``round(sync_every * t_fastest / t_i)`` for the others,
    at least ``min_steps``.

    Example:
        >>> plan_steps([0.2, 0.21, 0.0], 10, 0.1)
        [10, 10, 10]
    """
    known = [t for t in seconds_per_step if t > 0]
    if not known:
        return [sync_every] * len(seconds_per_step)
    fastest = min(known)
    return [sync_every if t <= 0 or t <= fastest * (1 + tolerance)
            else min(sync_every, max(min_steps, round(sync_every * fastest / t))) for t in seconds_per_step]


def link_sync_every(current: int, exchange_s: float, seconds_per_step: float, low: int, high: Optional[int],
                    share: float) -> int:
    """The fastest worker's ``H`` next round, from the round's exchange time and its compute
    (``current * seconds_per_step``): raised when ``exchange_s > share * compute``, lowered when
    ``exchange_s < share * compute / 2``, each time to ``ceil(exchange_s / (0.8 * share * seconds_per_step))``,
    within ``[low, high]``; unchanged when ``high`` is None or nothing is measured.

    Example:
        >>> link_sync_every(250, exchange_s=0.1, seconds_per_step=0.1, low=10, high=1000, share=0.1)
        13
    """
    if high is None or seconds_per_step <= 0 or exchange_s <= 0:
        return current
    compute = current * seconds_per_step
    aim = math.ceil(exchange_s / (AIM * share * seconds_per_step))
    if exchange_s > share * compute:
        return max(low, min(high, max(aim, current)))
    if exchange_s < LOWER * share * compute:
        return max(low, min(high, min(aim, current)))
    return current


class Pace:
    """One worker's rounds: where the round is, this worker's ``H``, samples per fragment and timings.

    Args:
        hyper: the DiLoCo settings (``sync_every``, ``fragments``, ``overlap_steps``, ``rounds``,
            ``speed_tolerance``, ``sync_every_max``, ``max_exchange_share``).

    Attributes: ``active`` (rounds by time or the link rule: a report at each exchange), ``round`` (rounds
    ended), ``start`` (the step the round began after), ``steps`` (this worker's ``H`` this round), ``base`` (the
    fastest worker's ``H``: ``sync_every``, or the link rule's), ``offsets``.

    Example:
        >>> pace = Pace(DiLoCoSettings(sync_every=4, rounds="time"))  # doctest: +SKIP
        >>> pace.due(4)  # doctest: +SKIP
        [0]
    """

    def __init__(self, hyper: object) -> None:
        self.fragments: int = hyper.fragments  # type: ignore[attr-defined]
        self.by_time = getattr(hyper, "rounds", "steps") == "time"
        self.tolerance: float = getattr(hyper, "speed_tolerance", 0.1)
        self.high: Optional[int] = getattr(hyper, "sync_every_max", None)
        self.share: float = getattr(hyper, "max_exchange_share", 0.1)
        self.low: int = hyper.sync_every  # type: ignore[attr-defined]
        self.min_steps = max(self.fragments, hyper.overlap_steps + 1)  # type: ignore[attr-defined]
        self.active = self.by_time or self.high is not None
        # the round (the same on every worker but steps and offsets)
        self.round = 0
        self.start = 0
        self.base = self.low
        self.steps = self.low
        self.next_steps = self.low
        self.offsets = sync_offsets(self.steps, self.fragments)
        self.started_in: dict[int, int] = {}  # fragment -> the round its exchange in flight started in
        # samples per fragment since its last exchange (1 per step unless add_samples)
        self.samples = [0] * self.fragments
        self._step_samples: Optional[int] = None
        # timings of this round, and of the last one ended
        self.compute_s = 0.0
        self.timed = 0
        self.wait_s = 0.0
        self.exchange_s = 0.0
        self.last_wait_s = 0.0
        self.last_exchange_s = 0.0
        self._mark: Optional[float] = None

    # -- samples and timings -----------------------------------------------------------------------------------

    def add_samples(self, n: int) -> None:
        """Count ``n`` samples in the current step (default 1 per step when never called in it)."""
        self._step_samples = (self._step_samples or 0) + int(n)

    def count_step(self) -> None:
        """Count the step's samples towards every fragment."""
        n = self._step_samples if self._step_samples is not None else 1
        self.samples = [s + n for s in self.samples]
        self._step_samples = None

    def computed(self, steps: int) -> None:
        """``steps`` inner steps end now: their compute is the time since the last :meth:`mark`."""
        now = time.monotonic()
        if self._mark is not None and steps > 0:
            self.compute_s += now - self._mark
            self.timed += steps

    def mark(self) -> None:
        """The end-of-step work is done: the next step's compute starts now."""
        self._mark = time.monotonic()

    @property
    def seconds_per_step(self) -> float:
        """This round's compute seconds per inner step so far (0: not measured)."""
        return self.compute_s / self.timed if self.timed else 0.0

    # -- the schedule --------------------------------------------------------------------------------------------

    def due(self, step: int) -> list[int]:
        """The fragments whose exchange starts after inner step ``step`` (each once per round, in order)."""
        k = step - self.start
        return [p for p, offset in enumerate(self.offsets) if offset == k]

    def round_over(self, step: int) -> bool:
        """Whether inner step ``step`` ends this worker's round."""
        return step - self.start >= self.steps

    def new_round(self, step: int) -> None:
        """Start the next round after inner step ``step``, with the steps the last report planned."""
        self.round += 1
        self.start = step
        self.steps = self.next_steps
        self.offsets = sync_offsets(self.steps, self.fragments)
        self.last_wait_s, self.last_exchange_s = self.wait_s, self.exchange_s
        self.compute_s, self.timed, self.wait_s, self.exchange_s = 0.0, 0, 0.0, 0.0

    # -- reports ---------------------------------------------------------------------------------------------------

    def row(self, tokens: float) -> torch.Tensor:
        """This worker's report row (:data:`ROW`), float64."""
        return torch.tensor([float(tokens), self.seconds_per_step, float(self.steps), self.last_wait_s,
                             self.last_exchange_s], dtype=torch.float64)

    def take_samples(self, part: int) -> int:
        """The samples behind fragment ``part``'s pseudo-gradient; its count starts again."""
        n, self.samples[part] = self.samples[part], 0
        return n

    def plan(self, table: torch.Tensor, me: int) -> list[int]:
        """From the round's report ``table`` (one :data:`ROW` per worker), set the link rule's ``base`` and this
        worker's (``me``) steps next round; return every worker's plan."""
        t = table[:, 1].tolist()
        known = [x for x in t if x > 0]
        fastest = min(known) if known else 0.0
        self.base = link_sync_every(self.base, float(table[:, 4].max()), fastest, self.low, self.high, self.share)
        plan = plan_steps(t, self.base, self.tolerance, self.min_steps) if self.by_time else [self.base] * len(t)
        self.next_steps = plan[me]
        return plan

    # -- checkpoints -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The round's position (``pace.*`` keys), empty when inactive (today's checkpoints)."""
        if not self.active:
            return {}
        return {"pace.round": torch.tensor(self.round), "pace.start": torch.tensor(self.start),
                "pace.steps": torch.tensor(self.steps), "pace.base": torch.tensor(self.base),
                "pace.next_steps": torch.tensor(self.next_steps)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned (nothing when it holds no ``pace.*`` keys)."""
        if "pace.round" not in state:
            return
        self.round, self.start = int(state["pace.round"]), int(state["pace.start"])
        self.steps, self.base = int(state["pace.steps"]), int(state["pace.base"])
        self.next_steps = int(state["pace.next_steps"])
        self.offsets = sync_offsets(self.steps, self.fragments)
