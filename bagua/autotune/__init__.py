"""Bagua autotune: tune bucket size, bucket order, hierarchical mode and TCP streams while training runs.

A library, not a service: rank 0 runs the optimizer (Optuna TPE), decisions travel as small tensors over the
process group, and every rank switches buckets at the same iteration. See docs/autotune.md.

Example:
    >>> import bagua.autotune
    >>> controller = bagua.autotune.attach(model, max_samples=20)  # doctest: +SKIP
"""

from __future__ import annotations

from bagua.autotune.controller import AutotuneController
from bagua.autotune.hooks import attach, choose_streams, detach, get_controller, on_wrap
from bagua.autotune.log import AutotuneLog, plot, read_log
from bagua.autotune.trial import bucket_plan
from bagua.autotune.settings import TuneSettings
from bagua.autotune.tuner import Hyperparameters, Tuner, TuneResult, TuneSpace, load_tune, save_tune, tune_environment

__all__ = [
    "AutotuneController", "bucket_plan", "attach", "choose_streams", "detach", "get_controller", "on_wrap",
    "AutotuneLog", "plot", "read_log", "Hyperparameters", "Tuner", "TuneResult", "TuneSpace", "TuneSettings",
    "load_tune", "save_tune", "tune_environment",
]
