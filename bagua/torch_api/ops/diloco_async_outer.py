"""Asynchronous DiLoCo's outer step: the global weights, changed one arriving pseudo-gradient at a time.

A worker's pseudo-gradient ``delta = g_b - x`` (``g_b``: the global weights of version ``b`` its round started
from, ``x``: its weights after its inner steps) is applied when it arrives, whatever the others do. The ``t``-th
arrival (from 1; the global weights are then at version ``t - 1``; ``N`` workers) is applied as follows:

1. **tokens**: its weight is ``w = tokens / mean``, ``mean`` the mean tokens per arrival over arrivals ``1..t``, so a
   slow worker's tokens count as much as anyone's (with equal rounds ``w = 1``);
2. **staleness** ``s = (t - 1) - b``, the arrivals applied since its base, is logged (``remedy="staleness"`` also
   scales ``w`` by ``min(1, N / (1 + s))``: ``s = N - 1`` is a normal asynchronous round; ``remedy="heloco"``, after
   HeLoCo's direction-aware correction, drops from a stale (``s >= N``) ``w * delta`` its component against the
   outer momentum, when they point apart);
3. **delayed Nesterov** (Async Local-SGD, Liu et al., arXiv 2401.09135): ``d = w * delta``; the global weights take
   the arrival's share of a synchronous round's plain step at once, ``g -= lr * d / N``, and the outer momentum
   moves only every ``N``-th arrival, on the mean of the ``N`` arrivals since its last move (``a``):
   Nesterov ``m = beta * m + a; g -= lr * beta * m``; heavy ball ``g -= lr * beta * m; m = beta * m + a``.
   With ``N`` arrivals from one base per ``N`` arrivals this is synchronous DiLoCo's SGD step exactly
   (``m = beta * m + a; g -= lr * (a + beta * m)``); one worker with ``momentum=0`` and ``lr=1`` takes ``g = x``.

``lr`` rises linearly over ``outer_lr_warmup = W`` virtual rounds of ``N`` arrivals: arrival ``t`` uses
``lr * min(1, (k + 1) / W)`` with ``k = (t - 1) // N``, as a synchronous run's ``k``-th round.

Why delayed Nesterov (:data:`DEFAULT_REMEDY`): measured with ``benchmarks/to_target/async_remedy.py --seeds 0 1 2``
(a small MLP on non-IID shards, AdamW inner steps, ``H = 10``, simulated time, eval loss at the same time; mean of
3 seeds, lower is better), at the default outer step for 2-4 workers (``"auto"``: lr 1, Nesterov 0.5, warm-up 10):

==================  ========  ================  =========  ======  =====
speeds              sync      delayed Nesterov  staleness  heloco  none
==================  ========  ================  =========  ======  =====
1, 1                0.253     0.272             0.272      0.272   0.303
1, 0.5              0.417     **0.305**         0.324      0.305   0.321
1, 0.8, 0.6, 0.4    0.871     **0.423**         0.455      0.423   0.432
==================  ========  ================  =========  ======  =====

Momentum moved on every arrival (``"none"``, naive asynchronous SGD) applies a stale direction ``N`` times per
round; delaying it wins in both unequal profiles. The HeLoCo-like correction (on top of it) almost never fired: a
stale pseudo-gradient still pointed along the momentum (the same figures; 0.685 against 0.679 in the one case it
changed), so it is not worth its two dot products. Scaling by staleness lost there, but won with DiLoCo's published
step (lr 0.7, Nesterov 0.9: 0.311 against 0.423 at speeds 1, 0.5; 0.489 against 0.679 at 1, 0.8, 0.6, 0.4), where
every asynchronous variant lost to the synchronous run (0.24-0.29) and naive momentum diverged (1.9-3.3): keep the
``"auto"`` outer step with ``asynchronous=True``. Async Local-SGD's other fix, dynamic local updates (a worker's
``H`` proportional to its speed, ``+dylu`` in the script), did not pay here (0.325 against 0.305 at speeds 1, 0.5;
0.412 against 0.423 at 1, 0.8, 0.6, 0.4, within the seeds' spread), so every worker takes ``sync_every`` steps.
With equal speeds asynchronous DiLoCo is a little worse than synchronous (0.272 against 0.253: a worker restarts
from weights that hold only part of the round): use it for unequal or changing speeds.

Example:
    >>> g = torch.zeros(2)
    >>> outer = AsyncOuter(g, workers=1, lr=1.0, momentum=0.0)
    >>> outer.apply(worker=0, tokens=8, base=0, delta=torch.tensor([1.0, -2.0])).version
    1
    >>> g
    tensor([-1.,  2.])
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["AsyncOuter", "Arrival", "REMEDIES", "DEFAULT_REMEDY"]

#: the staleness remedies :class:`AsyncOuter` knows (see the module's docstring)
REMEDIES = ("delayed_nesterov", "staleness", "heloco", "none")
#: the one asynchronous DiLoCo runs: chosen by the measurement in the module's docstring
DEFAULT_REMEDY = "delayed_nesterov"


class Arrival(NamedTuple):
    """One applied pseudo-gradient, as the server logged it: who sent it, the tokens behind it, the version its
    round started from, the version it made, its staleness and the weight it was applied with."""

    worker: int
    tokens: int
    base: int
    version: int
    staleness: int
    weight: float


class AsyncOuter:
    """Hold the global weights and apply arriving pseudo-gradients to them, one at a time, in arrival order.

    Args:
        global_: the global weights (a flat float32 tensor, changed in place).
        workers: ``N``, the workers that send pseudo-gradients.
        lr, momentum, nesterov, lr_warmup: the outer SGD's settings (resolved, not ``"auto"``).
        remedy: one of :data:`REMEDIES`.

    Attributes: ``version`` (arrivals applied), ``log`` (an :class:`Arrival` per arrival, in order).

    Example:
        >>> outer = AsyncOuter(torch.zeros(3), workers=2, lr=1.0, momentum=0.5)
        >>> outer.apply(worker=1, tokens=10, base=0, delta=torch.ones(3)).staleness
        0
    """

    def __init__(self, global_: torch.Tensor, workers: int, lr: float, momentum: float, nesterov: bool = True,
                 lr_warmup: int = 0, remedy: str = DEFAULT_REMEDY) -> None:
        if remedy not in REMEDIES:
            raise ValueError(f"AsyncOuter(remedy=...) must be one of {REMEDIES}, got {remedy!r}")
        if workers < 1:
            raise ValueError(f"AsyncOuter(workers=...) must be at least 1, got {workers}")
        # settings
        self.workers = workers
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.lr_warmup = int(lr_warmup)
        self.remedy = remedy
        # state
        self.global_ = global_
        self.version = 0
        self.tokens_total = 0
        self.buf: Optional[torch.Tensor] = torch.zeros_like(global_) if self.momentum > 0 else None
        self.acc: Optional[torch.Tensor] = torch.zeros_like(global_) if self.momentum > 0 else None
        self.log: list[Arrival] = []

    def lr_at(self, t: int) -> float:
        """The outer learning rate of the ``t``-th arrival (from 1), after the warm-up's ramp."""
        if self.lr_warmup <= 0:
            return self.lr
        k = (t - 1) // self.workers
        return self.lr * min(1.0, (k + 1) / self.lr_warmup)

    @torch.no_grad()
    def apply(self, worker: int, tokens: int, base: int, delta: torch.Tensor) -> Arrival:
        """Apply ``delta`` (``g_base - x``, on the global weights' device and dtype) from ``worker``, whose round
        of ``tokens`` tokens started from version ``base``; return what was logged."""
        if not 0 <= base <= self.version:
            raise ValueError(f"asynchronous DiLoCo: worker {worker} started from global version {base}, but the "
                             f"server is at version {self.version}: the workers' states come from different runs")
        if tokens < 1:
            raise ValueError(f"asynchronous DiLoCo: worker {worker} sent a round of {tokens} tokens; a round "
                             "holds at least one inner step")
        t = self.version + 1
        n = self.workers
        staleness = self.version - base
        self.tokens_total += int(tokens)
        weight = tokens * t / self.tokens_total  # tokens / (mean tokens per arrival)
        if self.remedy == "staleness":
            weight *= min(1.0, n / (1.0 + staleness))
        lr = self.lr_at(t)
        d = delta * weight
        if self.remedy == "heloco" and staleness >= n and self.buf is not None:
            # HeLoCo-like: a stale arrival loses its component against the outer momentum's direction
            dot, norm2 = float(torch.dot(d, self.buf)), float(torch.dot(self.buf, self.buf))
            if dot < 0 and norm2 > 0:
                d = d - self.buf * (dot / norm2)
        if self.remedy == "none" or self.buf is None or self.acc is None:
            if self.buf is not None:  # naive: the momentum moves on every arrival
                self.buf.mul_(self.momentum).add_(d)
                step = d.add(self.buf, alpha=self.momentum) if self.nesterov else self.buf
                self.global_.sub_(step, alpha=lr / n)
            else:
                self.global_.sub_(d, alpha=lr / n)
        else:
            self.global_.sub_(d, alpha=lr / n)
            self.acc.add_(d)
            if t % n == 0:
                if self.nesterov:
                    self.buf.mul_(self.momentum).add_(self.acc, alpha=1.0 / n)
                    self.global_.sub_(self.buf, alpha=lr * self.momentum)
                else:
                    self.global_.sub_(self.buf, alpha=lr * self.momentum)
                    self.buf.mul_(self.momentum).add_(self.acc, alpha=1.0 / n)
                self.acc.zero_()
        self.version = t
        arrival = Arrival(int(worker), int(tokens), int(base), t, staleness, float(weight))
        self.log.append(arrival)
        return arrival

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The global weights, version, tokens seen and the momentum tensors (for a checkpoint of the server)."""
        state = {"global": self.global_.clone(), "version": torch.tensor(self.version),
                 "tokens_total": torch.tensor(self.tokens_total)}
        if self.buf is not None and self.acc is not None:
            state["momentum"] = self.buf.clone()
            state["pending"] = self.acc.clone()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.global_.copy_(state["global"])
        self.version = int(state["version"])
        self.tokens_total = int(state["tokens_total"])
        if self.buf is not None and self.acc is not None and "momentum" in state:
            self.buf.copy_(state["momentum"])
            self.acc.copy_(state["pending"])
