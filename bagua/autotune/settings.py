"""What a tune is asked to do: :class:`TuneSettings`, checked once, shared by ``attach`` and the controller.

Example:
    >>> TuneSettings(max_samples=20, warmup_time_s=5).settle_steps
    2
    >>> TuneSettings(max_samples=0)
    Traceback (most recent call last):
    ...
    ValueError: max_samples must be >= 1, got 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from bagua.autotune.tuner import TuneSpace

__all__ = ["TuneSettings"]


@dataclass(frozen=True)
class TuneSettings:
    """The settings of one tune (see :class:`~bagua.autotune.controller.AutotuneController` for the steps).

    Args:
        max_samples: trials after the default measurement.
        warmup_time_s: seconds of training before the first measurement.
        sampling_confidence_time_s: the shortest measured window, in seconds.
        settle_steps: iterations after a change that are not measured.
        min_window_steps: the fewest iterations in a window.
        log_path: CSV log written by rank 0 (``None``: no log; ``"default"``: ``bagua_autotune_<model>.csv`` in
            the temp folder, as the original).
        tune_file: where the finished tune is saved and looked for (``None``: a file in the cache dir named
            after the model and the cluster); ``""`` disables saving and loading.
        reload: apply a saved tune of the same model and cluster instead of tuning.
        strategy: ``"tpe"`` or ``"grid"`` (exhaustive sweep).
        space: the search space (default: :meth:`TuneSpace.for_model`).
        seed: the sampler's seed.
    """

    max_samples: int = 60
    warmup_time_s: float = 30.0
    sampling_confidence_time_s: float = 5.0
    settle_steps: int = 2
    min_window_steps: int = 3
    log_path: Optional[str] = None
    tune_file: Optional[str] = None
    reload: bool = True
    strategy: str = "tpe"
    space: Optional[TuneSpace] = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {self.max_samples}")
        if self.warmup_time_s < 0 or self.sampling_confidence_time_s < 0:
            raise ValueError("warmup_time_s and sampling_confidence_time_s must be >= 0 seconds")
        if self.settle_steps < 0 or self.min_window_steps < 1:
            raise ValueError(f"need settle_steps >= 0 and min_window_steps >= 1, got {self.settle_steps}, "
                             f"{self.min_window_steps}")
