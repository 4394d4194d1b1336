"""Turning autotune (and the multistream allreduce) on for a Bagua model.

:func:`attach` starts tuning a wrapped model; :func:`on_wrap` is the one call the engine makes when it wraps a
model, so that ``BAGUA_AUTOTUNE=1`` (``--autotune_level 1``) and ``BAGUA_NET=1`` (``--enable_bagua_net``) work
without changing the training script.

Example:
    >>> import bagua.autotune
    >>> model = model.with_bagua([optimizer], GradientAllReduceAlgorithm())  # doctest: +SKIP
    >>> tuner = bagua.autotune.attach(model, max_samples=20, warmup_time_s=5)  # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from bagua.autotune.controller import AutotuneController
from bagua.autotune.settings import TuneSettings
from bagua.autotune.tuner import TuneSpace
from bagua.torch_api import communication, env, multistream
from bagua.torch_api.interfaces import Engine

__all__ = ["attach", "choose_streams", "detach", "get_controller", "on_wrap"]

_controllers: "weakref.WeakKeyDictionary[Any, AutotuneController]" = weakref.WeakKeyDictionary()
communication.on_shutdown(_controllers.clear, order=1)  # at exit: let the controllers' groups (and threads) go


def _engine(model: Any) -> Any:
    """The engine behind a module wrapped by ``with_bagua``, Bagua's ``DistributedDataParallel`` or the engine."""
    for attr in ("bagua_ddp", "inner"):
        engine = getattr(model, attr, None)
        if engine is not None:
            return engine
    if isinstance(model, Engine):
        return model
    raise ValueError(f"{type(model).__name__} is not wrapped by Bagua: call model.with_bagua(optimizers, algorithm) "
                     "before bagua.autotune.attach(model)")


def attach(
    model: Any,
    max_samples: Optional[int] = None,
    warmup_time_s: Optional[float] = None,
    sampling_confidence_time_s: Optional[float] = None,
    log_path: Optional[str] = None,
    tune_file: Optional[str] = None,
    reload: bool = True,
    strategy: str = "tpe",
    space: Optional[TuneSpace] = None,
    settle_steps: int = 2,
    min_window_steps: int = 3,
    seed: int = 0,
) -> AutotuneController:
    """Tune bucket size, bucket order, hierarchical mode and streams of ``model`` while it trains.

    Collective: every rank calls it right after wrapping, before training. Settings left ``None`` come from the
    launcher's flags (``--autotune_max_samples``, ``--autotune_warmup_time``,
    ``--autotune_sampling_confidence_time``; the log from ``--is_output_autotune_log``).

    Args:
        model: a module wrapped with ``with_bagua`` (or Bagua's ``DistributedDataParallel``).
        max_samples: trials after the default measurement.
        warmup_time_s: seconds before the first measurement.
        sampling_confidence_time_s: the shortest measured window.
        log_path: CSV log (``"default"``: ``bagua_autotune_<model>.csv`` in the temp folder).
        tune_file: where the finished tune is saved/looked for (default: in ``BAGUA_CACHE_DIR``; ``""``: never).
        reload: apply a saved tune of the same model and cluster instead of tuning again.
        strategy: ``"tpe"`` or ``"grid"``.
        space: the search space (default: derived from the model, the topology and the enabled streams).
        settle_steps: iterations after a change that are not measured.
        min_window_steps: the fewest iterations per measured window.
        seed: the sampler's seed.

    Returns:
        The :class:`AutotuneController`: ``.finished``, ``.current``, ``.result`` (rank 0), ``.applied``.

    Example:
        >>> ctl = bagua.autotune.attach(model, max_samples=20)  # doctest: +SKIP
    """
    engine = _engine(model)
    detach(engine)
    if log_path is None and env.get_is_output_autotune_log():
        log_path = "default"
    # the settings left None come from the launcher
    settings = TuneSettings(
        max_samples=env.get_autotune_max_samples() if max_samples is None else max_samples,
        warmup_time_s=env.get_autotune_warmup_time_s() if warmup_time_s is None else warmup_time_s,
        sampling_confidence_time_s=(env.get_autotune_sampling_confidence_time_s()
                                    if sampling_confidence_time_s is None else sampling_confidence_time_s),
        settle_steps=settle_steps, min_window_steps=min_window_steps, log_path=log_path, tune_file=tune_file,
        reload=reload, strategy=strategy, space=space, seed=seed)
    controller = AutotuneController(engine, settings)
    _controllers[engine] = controller
    return controller


def detach(model: Any) -> None:
    """Stop tuning ``model`` (its current buckets stay)."""
    controller = _controllers.pop(_engine(model), None)
    if controller is not None:
        controller.close()


def get_controller(model: Any) -> Optional[AutotuneController]:
    """The controller tuning ``model``, if any."""
    return _controllers.get(_engine(model))


def choose_streams(model: Any, warmup_time_s: float = 2.0, sampling_confidence_time_s: float = 2.0
                   ) -> AutotuneController:
    """Pick 1, 2 or 4 streams (those created) by measuring real training steps; a tune of the streams only.

    The bucket size stays the default; the choice is saved like any tune, so the next run of the same model on
    the same cluster starts with it. Collective, like :func:`attach`.
    """
    engine = _engine(model)
    msg = multistream.get(engine.process_group)
    if msg is None:
        raise ValueError("choose_streams() needs multistream.enable(...) for the model's group first")
    streams = tuple(s for s in (1, 2, 4, 8, 16) if s <= msg.max_streams)
    space = TuneSpace(num_streams=streams, bucket_size=env.get_default_bucket_size())
    return attach(engine, max_samples=len(streams), warmup_time_s=warmup_time_s,
                  sampling_confidence_time_s=sampling_confidence_time_s, strategy="grid", space=space)


def on_wrap(bagua_ddp: Any) -> None:
    """The engine's wrap-time hook: ``BAGUA_NET=1`` (``--enable_bagua_net``) and ``BAGUA_AUTOTUNE>=1``.

    With ``BAGUA_NET=1`` on gloo, the group gets a :class:`~bagua.torch_api.multistream.MultiStreamGroup`
    (starting at one stream) and the stream count is chosen on real training steps: by the full autotune when
    it is on, else by :func:`choose_streams`. Collective (every rank wraps its model at the same point). Does
    nothing when neither variable is set.
    """
    import torch.distributed as dist

    pg = bagua_ddp.process_group
    net = env.get_bool("BAGUA_NET") and dist.get_backend(pg.get_global_communicator().group) == "gloo"
    if net and multistream.get(pg) is None:
        multistream.enable(pg, calibrate_streams=False).num_streams = 1
    if env.get_autotune_level() >= 1:
        attach(bagua_ddp)
    elif net:
        choose_streams(bagua_ddp)
