"""The tuner: which hyper-parameters to try next, and the best found so far. Pure; runs on rank 0 only.

A *trial* is one set of :class:`Hyperparameters` measured for one window of training; its *score* is the
measured throughput (samples/s). :class:`Tuner` proposes trials with Optuna's TPE sampler (a Bayesian
optimizer, https://optuna.org) over a :class:`TuneSpace`, or walks the whole grid (``strategy="grid"``, the
exhaustive sweep the TPE result is compared with). A finished tune is a :class:`TuneResult`, saved as JSON by
:func:`save_tune` and read back by :func:`load_tune` for the next run of the same model on the same cluster.

Example:
    >>> space = TuneSpace(bucket_size_2p=(14, 20))
    >>> tuner = Tuner(space, max_samples=5, seed=0)
    >>> hp = tuner.ask()
    >>> tuner.tell(hp, score=100.0)
    >>> tuner.best()[0] == hp
    True
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

__all__ = [
    "Hyperparameters",
    "TuneSpace",
    "Tuner",
    "TuneResult",
    "save_tune",
    "load_tune",
    "signature",
    "tune_environment",
]


@dataclass(frozen=True)
class Hyperparameters:
    """What autotune changes while training runs.

    Args:
        bucket_size: bucket size in bytes (buckets close once they reach it; see ``split_bucket_by_bucket_size``).
        is_hierarchical_reduce: hierarchical allreduce (only where the group spans several multi-rank nodes).
        num_streams: parallel TCP streams of the multistream allreduce (1 = plain allreduce).
    """

    bucket_size: int
    is_hierarchical_reduce: bool = False
    num_streams: int = 1

    @property
    def bucket_size_2p(self) -> float:
        """``log2(bucket_size)``, the original Bagua's tuning coordinate."""
        return math.log2(self.bucket_size)


@dataclass(frozen=True)
class TuneSpace:
    """The grid autotune searches.

    Args:
        bucket_size_2p: inclusive range ``(lo, hi)`` of ``p``, bucket size ``2**p`` bytes.
        hierarchical: the hierarchical settings allowed (``(False,)`` where the topology does not allow it).
        num_streams: the stream counts allowed (``(1,)`` without multistream).
        bucket_size: a fixed bucket size in bytes (``bucket_size_2p`` is then not searched).
    """

    bucket_size_2p: tuple[int, int] = (14, 28)
    hierarchical: tuple[bool, ...] = (False,)
    num_streams: tuple[int, ...] = (1,)
    bucket_size: Optional[int] = None

    def __post_init__(self) -> None:
        lo, hi = self.bucket_size_2p
        if not 1 <= lo <= hi <= 40:
            raise ValueError(f"bucket_size_2p must be (lo, hi) with 1 <= lo <= hi <= 40, got {self.bucket_size_2p}")
        if not self.hierarchical or not self.num_streams:
            raise ValueError("hierarchical and num_streams each need at least one allowed value, e.g. (False,), (1,)")
        if any(s < 1 for s in self.num_streams):
            raise ValueError(f"num_streams values must be >= 1, got {self.num_streams}")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive number of bytes, got {self.bucket_size}")

    def sizes(self) -> list[int]:
        """The bucket sizes searched, smallest first."""
        if self.bucket_size is not None:
            return [self.bucket_size]
        lo, hi = self.bucket_size_2p
        return [2**p for p in range(lo, hi + 1)]

    @classmethod
    def for_model(cls, total_bytes: int, hierarchical_possible: bool = False, max_streams: int = 1,
                  min_bucket_2p: int = 14) -> "TuneSpace":
        """A space for a model of ``total_bytes`` of communicated tensors.

        Bucket sizes go from ``2**min_bucket_2p`` (16 KiB) to the first power of two holding the whole model
        (one bucket); stream counts are the powers of two up to ``max_streams``.
        """
        hi = max(min_bucket_2p + 1, math.ceil(math.log2(max(total_bytes, 2))))
        streams = tuple(s for s in (1, 2, 4, 8, 16) if s <= max_streams) or (1,)
        return cls((min_bucket_2p, hi), (False, True) if hierarchical_possible else (False,), streams)

    def grid(self) -> list[Hyperparameters]:
        """Every point of the space, smallest bucket first."""
        return [Hyperparameters(size, h, s)
                for size, h, s in itertools.product(self.sizes(), self.hierarchical, self.num_streams)]


class Tuner:
    """Propose trials and keep the scores; only rank 0 holds one.

    Args:
        space: the :class:`TuneSpace`.
        max_samples: trials to propose (the measured default is not one of them).
        strategy: ``"tpe"`` (Optuna's TPE sampler) or ``"grid"`` (every point of the space once, in order).
        seed: the sampler's seed (same seed and scores, same proposals).
        n_startup_trials: random trials before TPE models the scores; default ``max(3, min(10, max_samples // 3))``.
        confirm_top: the last trials (of ``max_samples``) measure again the best settings so far, one each, so
            that a lucky window does not win alone; default ``min(2, max_samples // 10)`` (``tpe`` only; with 10 %
            noise on a synthetic curve it raised the runs ending within 5 % of the optimum from 25 to 27 of 30).

    Example:
        >>> tuner = Tuner(TuneSpace((14, 16)), max_samples=3, strategy="grid")
        >>> [tuner.ask().bucket_size for _ in range(1)]
        [16384]
    """

    def __init__(self, space: TuneSpace, max_samples: int, strategy: str = "tpe", seed: int = 0,
                 n_startup_trials: Optional[int] = None, confirm_top: Optional[int] = None) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        if strategy not in ("tpe", "grid"):
            raise ValueError(f"unknown strategy {strategy!r}; available: 'tpe', 'grid'")
        # user settings
        self.space = space
        self.max_samples = max_samples
        self.strategy = strategy
        if confirm_top is None:
            confirm_top = min(2, max_samples // 10)
        self.confirm_top = confirm_top if strategy == "tpe" else 0
        # internal state
        self._pending: Optional[tuple[Hyperparameters, Any]] = None
        self._leaders: Optional[list[Hyperparameters]] = None
        self._grid = space.grid()
        self._study = None
        if strategy == "tpe":
            self._study = _new_study(seed, n_startup_trials or max(3, min(10, max_samples // 3)))
        # stats: every measurement, the default included
        self.records: list[tuple[Hyperparameters, float, str]] = []

    @property
    def trials_told(self) -> int:
        """Number of proposed trials that have a score."""
        return sum(1 for _, _, kind in self.records if kind == "trial")

    def finished(self) -> bool:
        """Whether every trial has been proposed and scored."""
        limit = self.max_samples if self.strategy == "tpe" else min(self.max_samples, len(self._grid))
        return self.trials_told >= limit

    def ask(self) -> Hyperparameters:
        """The next hyper-parameters to measure."""
        if self._pending is not None:
            raise RuntimeError("tell() the score of the last proposal before asking for the next one")
        if self._study is None:
            hp = self._grid[self.trials_told % len(self._grid)]
            self._pending = (hp, None)
            return hp
        confirming = self.trials_told - (self.max_samples - self.confirm_top)
        if confirming >= 0:
            if self._leaders is None:  # fixed when confirming starts, so each leader is measured once more
                self._leaders = [hp for hp, _ in self._ranked(kind="trial")[: self.confirm_top]]
            hp = self._leaders[min(confirming, len(self._leaders) - 1)]
            self._pending = (hp, None)
            return hp
        trial = self._study.ask()
        lo, hi = self.space.bucket_size_2p
        size = self.space.bucket_size or 2 ** trial.suggest_int("bucket_size_2p", lo, hi)
        h = self.space.hierarchical[0]
        if len(self.space.hierarchical) > 1:
            h = trial.suggest_categorical("is_hierarchical_reduce", list(self.space.hierarchical))
        s = self.space.num_streams[0]
        if len(self.space.num_streams) > 1:
            s = trial.suggest_categorical("num_streams", list(self.space.num_streams))
        hp = Hyperparameters(size, bool(h), int(s))
        self._pending = (hp, trial)
        return hp

    def tell(self, hp: Hyperparameters, score: float) -> None:
        """Record ``score`` for ``hp``: the pending proposal, or an outside measurement such as the default."""
        if not math.isfinite(score):
            raise ValueError(f"score must be a finite number, got {score}")
        if self._pending is not None and self._pending[0] == hp:
            _, trial = self._pending
            self._pending = None
            if trial is not None:
                self._study.tell(trial, score)
            self.records.append((hp, float(score), "trial"))
        else:
            self.records.append((hp, float(score), "default"))

    def best(self, kind: Optional[str] = None) -> tuple[Hyperparameters, float]:
        """The hyper-parameters with the highest mean score over their measurements (of ``kind``, ``"trial"`` or
        ``"default"``, when given), and that mean."""
        ranked = self._ranked(kind)
        if not ranked:
            raise RuntimeError("no score yet: tell() at least one measurement first")
        return ranked[0]

    def _ranked(self, kind: Optional[str] = None) -> list[tuple[Hyperparameters, float]]:
        scores: dict[Hyperparameters, list[float]] = {}
        for hp, score, k in self.records:
            if kind is None or k == kind:
                scores.setdefault(hp, []).append(score)
        means = [(hp, sum(v) / len(v)) for hp, v in scores.items()]
        return sorted(means, key=lambda item: -item[1])


def _new_study(seed: int, n_startup_trials: int) -> Any:
    try:
        import optuna
    except ImportError:
        raise ImportError("autotune needs Optuna: pip install 'bagua[autotune]' (or pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials, multivariate=True)
    return optuna.create_study(direction="maximize", sampler=sampler)


# -- a finished tune on disk ---------------------------------------------------------------------------------


@dataclass
class TuneResult:
    """A finished tune: the best hyper-parameters and bucket order of one model on one cluster.

    Args:
        model_signature: :func:`signature` of the model's communicated tensors and algorithm.
        cluster_signature: :func:`signature` of world size, node layout, backend and available streams.
        best: the chosen hyper-parameters.
        best_score: their mean measured throughput (samples/s).
        default_score: the throughput measured with the starting settings.
        tensor_order: tensor names in bucket order (the observed gradient-ready order), or empty.
        trials: every measurement as ``{"bucket_size", "is_hierarchical_reduce", "num_streams", "score", "kind"}``.
    """

    model_signature: str
    cluster_signature: str
    best: Hyperparameters
    best_score: float
    default_score: float
    tensor_order: list[str] = field(default_factory=list)
    trials: list[dict] = field(default_factory=list)


def signature(*parts: Any) -> str:
    """A short stable hash of JSON-serializable ``parts``."""
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def save_tune(path: str, result: TuneResult) -> None:
    """Write ``result`` to ``path`` as JSON (atomically: a reader never sees half a file)."""
    data = asdict(result)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def load_tune(path: str, model_signature: Optional[str] = None,
              cluster_signature: Optional[str] = None) -> Optional[TuneResult]:
    """Read a tune saved by :func:`save_tune`; ``None`` when missing or saved for another model or cluster.

    A file that is not a saved tune (truncated by a full disk, overwritten, hand-edited) is ignored with a
    ``RuntimeWarning`` that names it, so tuning starts afresh and its result replaces the file.

    Args:
        path: the JSON file.
        model_signature: when given, a tune saved for another model counts as missing.
        cluster_signature: when given, a tune saved for another cluster counts as missing.

    Returns:
        The saved :class:`TuneResult`, or ``None``.

    Example:
        >>> load_tune("/nonexistent/tune.json") is None
        True
    """
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        result = TuneResult(**{**data, "best": Hyperparameters(**data["best"])})
        # a well-formed JSON of the wrong shape must not reach the controller either
        if not isinstance(result.tensor_order, list) or not all(isinstance(n, str) for n in result.tensor_order):
            raise TypeError("tensor_order is not a list of names")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                   for v in (result.best.bucket_size, result.best.num_streams)):
            raise TypeError("bucket_size and num_streams must be positive integers")
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        # ValueError covers json.JSONDecodeError and UnicodeDecodeError
        warnings.warn(f"ignoring the saved autotune file {path}: it is not a saved tune ({type(error).__name__}: "
                      f"{error}); tuning starts afresh and will overwrite it", RuntimeWarning, stacklevel=2)
        return None
    if model_signature is not None and result.model_signature != model_signature:
        return None
    if cluster_signature is not None and result.cluster_signature != cluster_signature:
        return None
    return result


# -- settings fixed for a whole run (NCCL socket knobs, stream counts) -------------------------------------


def tune_environment(measure: Callable[[dict[str, str]], float], choices: dict[str, Sequence[str]],
                     max_samples: int = 20, seed: int = 0) -> tuple[dict[str, str], float, list]:
    """Tune environment variables that a process reads once, by running ``measure`` once per trial.

    Settings such as ``NCCL_SOCKET_NTHREADS`` are read when the first NCCL communicator is created, so they can
    only change between runs: ``measure(env)`` must start a (short) job with ``env`` added and return its
    throughput. The original Bagua's "system autotune" did the same over ssh.

    Args:
        measure: runs a job with the given variables and returns its score (higher is better).
        choices: the values allowed per variable.
        max_samples: runs to make (at most the number of combinations).
        seed: the TPE sampler's seed.

    Returns:
        ``(best_env, best_score, [(env, score), ...])``.

    Example:
        >>> tune_environment(lambda e: -abs(int(e["N"]) - 4), {"N": ["1", "2", "4", "8"]}, max_samples=4)[0]
        {'N': '4'}
    """
    keys = sorted(choices)
    total = math.prod(len(choices[k]) for k in keys)
    study = _new_study(seed, max(2, min(10, max_samples // 3)))
    seen: dict[tuple, float] = {}
    history = []
    for _ in range(min(max_samples, total)):
        trial = study.ask()
        values = tuple(str(trial.suggest_categorical(k, list(choices[k]))) for k in keys)
        if values in seen:  # a repeat costs no run: the sampler gets the score it already has
            study.tell(trial, seen[values])
            continue
        environ = dict(zip(keys, values))
        score = float(measure(environ))
        seen[values] = score
        history.append((environ, score))
        study.tell(trial, score)
    best_env, best_score = max(history, key=lambda item: item[1])
    return best_env, best_score, history
