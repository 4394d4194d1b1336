"""DiLoCo's ``"auto"`` outer step: ``outer_lr``, ``outer_momentum`` and ``outer_lr_warmup`` from the workers and ``H``.

The rule comes from the sweeps in ``docs/algorithms/diloco.md`` ("The outer step: outer_lr="auto""): the project's
GPT (10.8 M parameters, Adam inner steps, 8 x 128 bytes per worker and step), loss and steps to the benchmark's
target against DDP's on the same seeds, at 2 and 4 workers and ``sync_every`` of 5 to 50:

- up to ``H = 20`` (measured at 10): the outer learning rate 1.0 with Nesterov momentum 0.5, rising linearly over
  the first 10 outer steps (``outer_lr_warmup=10``); without the warm-up the same step made slower progress than
  plain averaging, with it fewer steps than DDP at 4 workers on 3 seeds;
- plain averaging (``outer_lr=1.0``, no momentum: FedAvg, post-local SGD) from there up to ``H = 100``, the best
  *constant* outer step found at 2 workers with ``H = 50``;
- the published setting (``outer_lr=0.7``, Nesterov 0.9, DiLoCo's paper, torchft's default) stalled at 2 workers
  with ``H`` of 10 and 50. It was tuned for hundreds of inner steps and 8 or more replicas, where a round's
  averaged pseudo-gradient is small and well averaged; it is what ``"auto"`` gives there (``H >= 100`` and at
  least 8 workers), unmeasured here. Below 8 workers with ``H >= 100``: plain averaging, the setting that never
  stalled.

A single worker (nothing to average) gets the identity step (lr 1.0, no momentum): its weights are its own.

Example:
    >>> auto_outer(workers=4, sync_every=10)
    OuterStep(lr=1.0, momentum=0.5, warmup=10)
    >>> auto_outer(workers=16, sync_every=500)
    OuterStep(lr=0.7, momentum=0.9, warmup=0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

__all__ = ["AUTO", "OuterStep", "auto_outer", "resolve_outer"]

#: the value of ``outer_lr`` / ``outer_momentum`` that asks for :func:`auto_outer`'s choice
AUTO = "auto"
#: from here on (H and workers) the published DiLoCo step: its paper's regime
PUBLISHED_FROM_H, PUBLISHED_FROM_WORKERS = 100, 8
#: up to this H, the warmed-up Nesterov step measured at H = 10
WARMED_UP_TO_H = 20


class OuterStep(NamedTuple):
    """The default outer optimizer's settings: SGD's learning rate, its Nesterov momentum, and the outer steps over
    which the learning rate rises linearly to ``lr`` (``outer_lr_warmup``; 0: none)."""

    lr: float
    momentum: float
    warmup: int


def auto_outer(workers: int, sync_every: int) -> OuterStep:
    """The outer step ``"auto"`` stands for with ``workers`` replicas averaging every ``sync_every`` inner steps."""
    if workers < 1 or sync_every < 1:
        raise ValueError(f"auto_outer needs workers >= 1 and sync_every >= 1, got {workers} and {sync_every}")
    if workers == 1:
        return OuterStep(1.0, 0.0, 0)
    if sync_every >= PUBLISHED_FROM_H and workers >= PUBLISHED_FROM_WORKERS:
        return OuterStep(0.7, 0.9, 0)
    if sync_every <= WARMED_UP_TO_H:
        return OuterStep(1.0, 0.5, 10)
    return OuterStep(1.0, 0.0, 0)


def resolve_outer(hyper: Any, workers: int) -> Any:
    """``hyper`` (a :class:`~bagua.torch_api.algorithms.diloco.DiLoCoAlgorithm`) with each ``"auto"`` outer setting
    replaced by :func:`auto_outer`'s for ``workers``; unchanged when none is ``"auto"``.

    ``outer_lr_warmup="auto"`` takes the rule's warm-up only with the rule's learning rate: a learning rate set by
    hand gets no warm-up unless one is asked for."""
    settings = (hyper.outer_lr, hyper.outer_momentum, hyper.outer_lr_warmup)
    if AUTO not in settings:
        return hyper
    rule = auto_outer(workers, hyper.sync_every)
    warmup = hyper.outer_lr_warmup
    if warmup == AUTO:
        warmup = rule.warmup if hyper.outer_lr == AUTO else 0
    return dataclasses.replace(
        hyper, outer_lr=rule.lr if hyper.outer_lr == AUTO else hyper.outer_lr,
        outer_momentum=rule.momentum if hyper.outer_momentum == AUTO else hyper.outer_momentum,
        outer_lr_warmup=warmup)
