"""The autotune controller: measures throughput while a Bagua model trains and switches its buckets.

Every rank runs one :class:`AutotuneController` per model; rank 0 also holds the :class:`~bagua.autotune.tuner.Tuner`.
Steps of a tune, all on public torch hooks registered by the controller itself:

1. **Warmup** (``warmup_time_s``): training runs untouched; the gradient-ready order of the parameters is
   recorded (``Tensor.register_post_accumulate_grad_hook``).
2. **Default**: one window is measured with the settings training started with.
3. **Trials** (``max_samples``): rank 0 asks the tuner, every rank applies the proposal (buckets rebuilt in the
   observed order, at the proposed size; hierarchical on/off; streams), one window is measured, rank 0 tells
   the tuner the score.
4. **Best**: the best measured settings are applied and measured once more (logged as ``best``), the tune is
   saved for the next run, and the controller removes its hooks.

A *window* starts ``settle_steps`` iterations after a change (the first steps pay for new buffers) and lasts
at least ``sampling_confidence_time_s`` and ``min_window_steps`` iterations. An iteration ends at
``optimizer.step()`` of the first optimizer; its samples are the leading dimension of the training forwards'
first tensor input. The score is the global throughput over the window, samples/s, with outlier iterations
(over twice the median: a checkpoint, an evaluation) counted at the median.

Decisions are taken at *check* iterations known to every rank: all ranks sum their window statistics
(one ``all_reduce``), rank 0 decides, and broadcasts a small int64 tensor ``[action, iteration, bucket_size,
hierarchical, streams, ordered, next_check, trial]`` (then, once, the tensor order as indices). Every rank
applies it at once, i.e. at the same iteration and the same ``bagua_train_step_counter``. These collectives
run on a group of their own, so they never interleave with the algorithm's communication.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import asdict
from typing import Any, Optional

import torch
import torch.distributed as dist

from bagua.autotune.log import AutotuneLog, default_log_path, describe
from bagua.autotune.settings import TuneSettings
from bagua.autotune.trial import batch_size, bucket_plan, robust_elapsed
from bagua.autotune.tuner import Hyperparameters, Tuner, TuneResult, TuneSpace, load_tune, save_tune, signature
from bagua.torch_api import env, multistream

# the last four from settings, trial and log, where they live
__all__ = ["AutotuneController", "TuneSettings", "bucket_plan", "default_log_path", "describe"]

logger = logging.getLogger(__name__)

# decision actions
_CONTINUE, _RESTART, _APPLY, _FINISH, _DONE, _LOAD, _NONE = range(7)
_WARMUP, _DEFAULT, _TRIAL, _CONFIRM, _FINISHED = "warmup", "default", "trial", "confirm", "finished"
_FIELDS = 8


class AutotuneController:
    """Tune one Bagua-wrapped model while it trains (see the module docstring for the steps).

    Creating it is collective: every rank of the model's group creates it at the same point (right after
    wrapping). Prefer :func:`bagua.autotune.attach`.

    Args:
        bagua_ddp: the engine (``model.bagua_ddp``).
        settings: what to tune and how (:class:`~bagua.autotune.settings.TuneSettings`; default: its defaults).
        overrides: fields of :class:`~bagua.autotune.settings.TuneSettings` that replace those of ``settings``
            (``AutotuneController(engine, max_samples=20)``).
    """

    def __init__(self, bagua_ddp: Any, settings: Optional[TuneSettings] = None, **overrides: Any) -> None:
        settings = dataclasses.replace(settings or TuneSettings(), **overrides)  # checks the settings
        if not bagua_ddp.bagua_optimizers:
            raise ValueError("autotune counts iterations by optimizer.step(): wrap the model with its optimizer(s)")
        self.ddp = bagua_ddp
        self.settings = settings
        self._init_topology()
        self._init_search()
        self._init_window()
        # stats, identical on every rank: (iteration, bagua_train_step_counter, hyper-parameters, ordered)
        self.applied: list[tuple[int, int, Hyperparameters, bool]] = []
        self.result: Optional[TuneResult] = None
        if settings.reload and self.tune_file and self._load_saved():
            return
        if self._is_root:
            logger.info(
                "autotune: started on %d rank(s): %d trial(s) after %.0f s of warmup, windows of >= %.1f s, "
                "starting from %s%s; the tune will be saved to %s", len(self._ranks), settings.max_samples,
                settings.warmup_time_s, settings.sampling_confidence_time_s, describe(self.default),
                f"; CSV log {self.log_path}" if self.log_path else "", self.tune_file or "(nowhere: tune_file='')")
        self._register_hooks()

    def _init_topology(self) -> None:
        """The ranks, the controller's own group and device, the streams, whether hierarchical mode is tuned."""
        pg = self.ddp.process_group
        comm = pg.get_global_communicator()
        self._ranks = list(comm.ranks)
        self._is_root = dist.get_rank() == self._ranks[0]
        self._group = pg.auxiliary_group("autotune")  # created once per engine group; never mixes with buckets
        self._device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(comm.group) == "nccl" \
            else torch.device("cpu")
        self._msg = multistream.get(pg)
        # only a mode switch the algorithm accepts both ways (shift_one needs an even number of peers in either)
        self._tunes_hierarchical = pg.is_hierarchical_possible() and all(
            self.ddp.impl.accepts_hierarchical(h) for h in (True, False)
        )

    def _init_search(self) -> None:
        """The search space, the signatures that name the tune, the tune file, the default settings, the tuner."""
        settings, impl, tensors = self.settings, self.ddp.impl, self.ddp.bagua_tensors
        pg, max_streams = self.ddp.process_group, self._msg.max_streams if self._msg else 1
        self._names = [t.name for t in tensors]
        total_bytes = sum(t.numel() * t.param.element_size() for t in tensors)
        self.space = settings.space or TuneSpace.for_model(total_bytes, self._tunes_hierarchical, max_streams)
        self.model_signature = signature(type(impl).__name__, [(t.name, list(t.shape), str(t.dtype)) for t in tensors])
        self.cluster_signature = signature(len(self._ranks), pg.node_layout(),
                                           dist.get_backend(pg.get_global_communicator().group), max_streams)
        space_signature = signature(asdict(self.space), settings.strategy)  # another search: another file
        name = f"{self.model_signature}-{self.cluster_signature}-{space_signature}.json"
        self.tune_file = settings.tune_file if settings.tune_file is not None else os.path.join(
            env.get_cache_dir(), "autotune", name)
        self.default = Hyperparameters(env.get_default_bucket_size(), bool(getattr(impl, "hierarchical", False)),
                                       self._msg.num_streams if self._msg else 1)
        self.current = self.default
        self._tuner: Optional[Tuner] = Tuner(self.space, settings.max_samples, settings.strategy,
                                             settings.seed) if self._is_root else None
        log_path = settings.log_path
        self.log_path = default_log_path(self.model_signature) if log_path == "default" else log_path
        self._log = AutotuneLog(self.log_path) if (self.log_path and self._is_root) else None

    def _init_window(self) -> None:
        """The phase, the iteration counters and the measured window, at their start."""
        self.phase = _WARMUP
        self.iteration = 0
        self._next_check = 1
        self._t_attach = time.perf_counter()
        self._order: Optional[list[str]] = None
        self._ready_now: list[int] = []
        self._ready_last: list[int] = []
        self._since_change = 0
        self._t_last: Optional[float] = None
        self._durations: list[float] = []
        self._samples = 0
        self._samples_pending = 0
        self._step_time = 0.0
        self._trial = 0
        self._best_ordered = False
        self._handles: list[Any] = []
        self._order_handles: list[Any] = []

    # -- hooks -------------------------------------------------------------------------------------------------

    def _register_hooks(self) -> None:
        module = self.ddp.module
        self._handles.append(module.register_forward_pre_hook(self._on_forward_pre))
        self._handles.append(self.ddp.bagua_optimizers[0].register_step_post_hook(self._on_iteration_end))
        tensors = self.ddp.bagua_tensors
        index = {id(t.param): i for i, t in enumerate(tensors)}
        for t in tensors:
            if isinstance(t.param, torch.Tensor) and t.param.requires_grad:
                i = index[id(t.param)]
                self._order_handles.append(t.param.register_post_accumulate_grad_hook(
                    lambda p, i=i: self._ready_now.append(i)))

    def close(self) -> None:
        """Remove every hook (tuning stops where it is; the current buckets stay)."""
        for handle in self._handles + self._order_handles:
            handle.remove()
        self._handles, self._order_handles = [], []
        self.phase = _FINISHED

    @property
    def finished(self) -> bool:
        """Whether tuning is over (finished, reloaded or closed)."""
        return self.phase == _FINISHED

    def _on_forward_pre(self, module: torch.nn.Module, inputs: Any) -> None:
        if module.training:
            self._samples_pending += batch_size(inputs)

    def _on_iteration_end(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if getattr(self.ddp.module, "bagua_ddp", self.ddp) is not self.ddp:
            self.close()  # the model was re-wrapped; this engine is closed
            return
        now = time.perf_counter()
        self.iteration += 1
        self._since_change += 1
        if self._ready_now:
            self._ready_last, self._ready_now = self._ready_now, []
        if self._t_last is not None:
            self._step_time = now - self._t_last if self._step_time == 0 else 0.8 * self._step_time + 0.2 * (
                now - self._t_last)
            if self._since_change > self.settings.settle_steps:
                self._durations.append(now - self._t_last)
                self._samples += self._samples_pending
        self._t_last = now
        self._samples_pending = 0
        if self.iteration >= self._next_check:
            self._check(now)

    # -- the collective decision -------------------------------------------------------------------------------

    def _check(self, now: float) -> None:
        stats = torch.tensor([float(self._samples), robust_elapsed(self._durations), float(len(self._durations))],
                             dtype=torch.float64, device=self._device)
        dist.all_reduce(stats, group=self._group)
        decision = torch.zeros(_FIELDS, dtype=torch.int64, device=self._device)
        if self._is_root:
            decision = torch.tensor(self._decide(now, *stats.tolist()), dtype=torch.int64, device=self._device)
        dist.broadcast(decision, src=self._ranks[0], group=self._group)
        self._follow([int(v) for v in decision.tolist()])

    def _decide(self, now: float, samples: float, elapsed_sum: float, steps_sum: float) -> list[int]:
        """Rank 0: the next decision from the summed window statistics."""
        n = len(self._ranks)
        elapsed, steps = elapsed_sum / n, steps_sum / n
        if self.phase == _WARMUP:
            left = self.settings.warmup_time_s - (now - self._t_attach)
            if left > 0:
                return self._encode(_CONTINUE, self.current, next_in=self._iterations_for(left))
            return self._encode(_RESTART, self.current, next_in=self._window_iterations())
        settings = self.settings
        if steps < settings.min_window_steps or elapsed < settings.sampling_confidence_time_s:
            missing = max(settings.min_window_steps - steps,
                          self._iterations_for(settings.sampling_confidence_time_s - elapsed))
            return self._encode(_CONTINUE, self.current, next_in=max(1, int(missing)))
        score = samples / elapsed if elapsed > 0 else 0.0
        assert self._tuner is not None
        if self._log is not None:
            self._log.write(self.current, score, self.ddp.bagua_train_step_counter, self._trial,
                            "best" if self.phase == _CONFIRM else self.phase, int(steps), elapsed)
        self._log_window(score, steps, elapsed)
        if self.phase == _CONFIRM:
            self._save(score)
            return self._encode(_DONE, self.current)
        self._tuner.tell(self.current, score)
        if self._tuner.finished():
            best, best_score = self._best()
            self._best_ordered = best is not self.default
            return self._encode(_FINISH, best, ordered=self._best_ordered, next_in=self._window_iterations())
        self._trial += 1
        return self._encode(_APPLY, self._tuner.ask(), ordered=True, next_in=self._window_iterations())

    def _log_window(self, score: float, steps: float, elapsed: float) -> None:
        """Rank 0: one log record per measured window."""
        what = {_DEFAULT: "default", _TRIAL: f"trial {self._trial}/{self.settings.max_samples}",
                _CONFIRM: "chosen, re-measured"}.get(self.phase, self.phase)
        logger.info("autotune: %s: %s: %.1f samples/s (%d steps in %.1f s)", what, describe(self.current), score,
                    steps, elapsed)
        if self.phase == _CONFIRM:
            assert self._tuner is not None
            default = next((s for _, s, kind in self._tuner.records if kind == "default"), 0.0)
            logger.info("autotune: chose %s: %.1f samples/s, %.2fx the default (%.1f samples/s)",
                        describe(self.current), score, score / default if default > 0 else float("nan"), default)

    def _best(self) -> tuple[Hyperparameters, float]:
        """The best trial, or the default (returned as ``self.default`` itself) when nothing beat it."""
        assert self._tuner is not None
        hp, mean = self._tuner.best(kind="trial")
        defaults = [s for _, s, kind in self._tuner.records if kind == "default"]
        if defaults and defaults[0] >= mean:
            return self.default, defaults[0]
        return hp, mean

    def _iterations_for(self, seconds: float) -> int:
        if self._step_time <= 0:
            return 1
        return max(1, min(10_000, math.ceil(seconds / self._step_time)))

    def _window_iterations(self) -> int:
        settings = self.settings
        return settings.settle_steps + max(settings.min_window_steps,
                                           self._iterations_for(settings.sampling_confidence_time_s))

    def _encode(self, action: int, hp: Hyperparameters, ordered: bool = False, next_in: int = 1) -> list[int]:
        return [action, self.iteration, hp.bucket_size, int(hp.is_hierarchical_reduce), hp.num_streams,
                int(ordered), self.iteration + max(1, next_in), self._trial]

    def _follow(self, decision: list[int]) -> None:
        """Every rank: carry out rank 0's decision."""
        action, iteration, bucket_size, hierarchical, streams, ordered, next_check, trial = decision
        if iteration != self.iteration:
            raise RuntimeError(
                f"autotune: rank {dist.get_rank()} is at iteration {self.iteration} but rank {self._ranks[0]} at "
                f"{iteration}; every rank must call optimizer.step() the same number of times")
        self._next_check = next_check
        self._trial = trial
        if action == _CONTINUE:
            return
        if action == _DONE:
            self.close()
            return
        if ordered and self._order is None:
            self._order = self._broadcast_order(self._ready_last)
            for handle in self._order_handles:
                handle.remove()
            self._order_handles = []
        if action in (_APPLY, _FINISH):
            self._apply(Hyperparameters(bucket_size, bool(hierarchical), streams), bool(ordered))
        self.phase = {_RESTART: _DEFAULT, _APPLY: _TRIAL, _FINISH: _CONFIRM}[action]
        self._restart_window()

    def _restart_window(self) -> None:
        self._since_change = 0
        self._durations = []
        self._samples = 0

    def _broadcast_order(self, ready: list[int]) -> list[str]:
        """Rank 0's observed gradient-ready order, as tensor names, on every rank."""
        n = len(self._names)
        order = torch.zeros(n, dtype=torch.int64, device=self._device)
        if self._is_root:
            seen = list(dict.fromkeys(ready))
            seen += [i for i in range(n) if i not in set(seen)]
            order = torch.tensor(seen, dtype=torch.int64, device=self._device)
        dist.broadcast(order, src=self._ranks[0], group=self._group)
        return [self._names[i] for i in order.tolist()]

    def _apply(self, hp: Hyperparameters, ordered: bool) -> None:
        """Rebuild the buckets for ``hp`` (and switch hierarchical mode and streams)."""
        if self._tunes_hierarchical:
            self.ddp.impl.hierarchical = hp.is_hierarchical_reduce
        if self._msg is not None:
            self._msg.num_streams = min(hp.num_streams, self._msg.max_streams)
        plan = bucket_plan(self.ddp.bagua_tensors, self._order if ordered else None, hp.bucket_size)
        self.ddp.rebucket(plan)
        self.current = hp
        self.applied.append((self.iteration, self.ddp.bagua_train_step_counter, hp, ordered))

    # -- saved tunes -------------------------------------------------------------------------------------------

    def _save(self, confirmed_score: float) -> None:
        """Rank 0: remember the result (and write it to ``tune_file``)."""
        assert self._tuner is not None
        default_score = next((s for _, s, kind in self._tuner.records if kind == "default"), 0.0)
        self.result = TuneResult(
            self.model_signature, self.cluster_signature, self.current, confirmed_score, default_score,
            list(self._order) if (self._order and self._best_ordered) else [],
            [dict(bucket_size=hp.bucket_size, is_hierarchical_reduce=hp.is_hierarchical_reduce,
                  num_streams=hp.num_streams, score=s, kind=kind) for hp, s, kind in self._tuner.records],
        )
        if self.tune_file:
            save_tune(self.tune_file, self.result)
            logger.info("autotune: saved the tune to %s; the next run of this model on this cluster reloads it "
                        "(delete the file, or attach(..., reload=False), to tune again)", self.tune_file)

    def _load_saved(self) -> bool:
        """Collective: rank 0 looks for a saved tune; when found every rank applies it and tuning is skipped."""
        saved = load_tune(self.tune_file, self.model_signature, self.cluster_signature) if self._is_root else None
        decision = torch.full((_FIELDS,), _NONE, dtype=torch.int64, device=self._device)
        if saved is not None:
            decision = torch.tensor(self._encode(_LOAD, saved.best, ordered=bool(saved.tensor_order)),
                                    dtype=torch.int64, device=self._device)
        dist.broadcast(decision, src=self._ranks[0], group=self._group)
        action, _, bucket_size, hierarchical, streams, ordered, _, _ = [int(v) for v in decision.tolist()]
        if action != _LOAD:
            return False
        if ordered:
            index = {name: i for i, name in enumerate(self._names)}
            self._order = self._broadcast_order([index[n] for n in saved.tensor_order if n in index]
                                                if saved is not None else [])
        self._apply(Hyperparameters(bucket_size, bool(hierarchical), streams), bool(ordered))
        self.result = saved
        self.phase = _FINISHED
        if self._is_root:
            logger.info("autotune: reloaded the tune saved at %s: %s; not tuning (delete the file, or "
                        "attach(..., reload=False), to tune again)", self.tune_file,
                        describe(self.current))
        return True
