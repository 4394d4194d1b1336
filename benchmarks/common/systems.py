"""The systems the workload trains with: torch DDP variants and Bagua algorithms, wrapped and instrumented.

A *system* is a spec ``name[:key=value...]`` (:func:`split_system`): ``ddp``, ``ddp_fp16``, ``ddp_bf16``,
``ddp_powersgd``,
``ddp_bytegrad[:codec=uint8:error_feedback=True...]`` (Bagua's ByteGrad as a DDP comm hook, the arguments of
``ByteGradState``),
``ddp_post_local_sgd[:period=P:warmup=W]`` (torch's post-local SGD, :func:`_post_local_sgd`) or a name in Bagua's
algorithm registry (:func:`available_systems`). ``inner=muon`` (or ``adam``, ``sgd``) on ``ddp`` or a Bagua
algorithm other than ``qadam`` picks the inner optimizer (:data:`INNER_OPTIMIZERS`), e.g.
``diloco:sync_every=10:inner=muon``. :func:`make_system` wraps a model for it, builds its
optimizer and times its communication (:class:`_IntervalTimer`); :func:`untimed_steps` and
:func:`qadam_warmup_steps` size the start-up phase left untimed.

Part of :mod:`benchmarks.common.workload`, which re-exports these public names.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional, Union

import torch

__all__ = ["DDP_SYSTEMS", "INNER_OPTIMIZERS", "split_system", "load_algorithm_modules", "available_systems",
           "System", "untimed_steps", "qadam_warmup_steps", "make_system", "POST_LOCAL_SGD_DEFAULTS", "steps_per_round"]

DDP_SYSTEMS = ("ddp", "ddp_fp16", "ddp_bf16", "ddp_powersgd", "ddp_post_local_sgd", "ddp_bytegrad")

#: ``ddp_post_local_sgd``'s options: average the weights every ``period`` steps after ``warmup`` steps of plain
#: DDP; compare with a local-update algorithm by giving it the same period (e.g. ``period=8`` for 8 inner steps)
POST_LOCAL_SGD_DEFAULTS = {"period": 4, "warmup": 2}


def split_system(spec: str) -> tuple[str, dict[str, Any]]:
    """Split a system spec ``name[:key=value[:key=value...]]`` into the name and the algorithm's arguments.

    Example:
        >>> split_system("decentralized:peer_selection_mode=shift_one:communication_interval=2")
        ('decentralized', {'peer_selection_mode': 'shift_one', 'communication_interval': 2})
    """
    import ast

    name, *pairs = spec.split(":")
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"system {spec!r}: write extra arguments as name:key=value, e.g. "
                             "decentralized:peer_selection_mode=shift_one")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return name, kwargs


def load_algorithm_modules() -> None:
    """Import every module of ``bagua.torch_api.algorithms``, so that algorithms register their names even
    before the package imports them; a module that fails to import is reported and skipped."""
    import importlib
    import pkgutil
    import sys
    import warnings

    import bagua.torch_api.algorithms as package

    for info in pkgutil.iter_modules(package.__path__):
        name = f"{package.__name__}.{info.name}"
        if name in sys.modules:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - one broken algorithm must not stop the others
            print(f"bagua-bench: skipping {name}: {type(exc).__name__}: {exc}", file=sys.stderr)


def available_systems() -> list[str]:
    """:data:`DDP_SYSTEMS`, then every registered Bagua algorithm name."""
    from bagua.torch_api.algorithms import GlobalAlgorithmRegistry

    load_algorithm_modules()
    return list(DDP_SYSTEMS) + GlobalAlgorithmRegistry.available_algorithms()


class _IntervalTimer:
    """Collects (start, end) intervals from any thread; ``busy()`` is the length of their union."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []

    def add(self, start: float, end: float) -> None:
        with self._lock:
            self._intervals.append((start, end))

    def take(self) -> float:
        """Length of the union of the intervals collected since the last call; clears them."""
        with self._lock:
            intervals, self._intervals = sorted(self._intervals), []
        total, cur_start, cur_end = 0.0, None, None
        for start, end in intervals:
            if cur_end is None or start > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        if cur_end is not None:
            total += cur_end - cur_start
        return total


@dataclass
class System:
    """A model wrapped for distributed training, with its optimizer and instrumentation."""

    model: torch.nn.Module
    optimizer: Union[torch.optim.Optimizer, _Optimizers]
    no_sync: Callable[[], ContextManager]
    timer: Optional[_IntervalTimer]
    before_step: Callable[[], None] = lambda: None
    close: Callable[[], None] = lambda: None
    notes: list[str] = field(default_factory=list)


def _make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr) if kind == "adam" else torch.optim.SGD(params, lr=lr)


#: inner optimizers a system spec can ask for with ``inner=NAME`` (default: the model's, Adam or SGD)
INNER_OPTIMIZERS = ("adam", "sgd", "muon")
#: ``inner=muon``: torch's Muon (momentum 0.95, Nesterov, no weight decay, its ``original`` learning-rate scaling)
#: on the 2-D weights of the hidden layers, at this learning rate; embeddings, biases and norms stay on Adam
MUON_LR = 0.02


class _Optimizers:
    """Several optimizers stepped as one by the training loop (``zero_grad`` / ``step``); the wrapped model gets
    the list (``with_bagua(optimizers, ...)`` waits for all of them before a synchronization)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def _inner_optimizers(kind: str, model: torch.nn.Module, lr: float) -> list[torch.optim.Optimizer]:
    """The inner optimizers of ``model`` for ``kind`` (:data:`INNER_OPTIMIZERS`); ``lr`` is Adam's or SGD's."""
    if kind not in INNER_OPTIMIZERS:
        raise ValueError(f"inner={kind!r}: choose one of {', '.join(INNER_OPTIMIZERS)}")
    if kind != "muon":
        return [_make_optimizer(kind, model.parameters(), lr)]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    matrices = [p for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings]
    rest = [p for p in model.parameters() if p.dim() != 2 or id(p) in embeddings]
    if not matrices:
        raise ValueError("inner=muon: the model has no 2-D hidden weights for Muon to train")
    return [torch.optim.Muon(matrices, lr=MUON_LR, weight_decay=0.0), torch.optim.Adam(rest, lr=lr)]


def _build_optimizer(kind: str, model: torch.nn.Module, lr: float) -> Union[torch.optim.Optimizer, _Optimizers]:
    """The training loop's optimizer for ``kind``: the one optimizer, or several stepped as one."""
    optimizers = _inner_optimizers(kind, model, lr)
    return optimizers[0] if len(optimizers) == 1 else _Optimizers(optimizers)


def _timed_hook(hook: Callable, timer: _IntervalTimer) -> Callable:
    """Wrap a DDP comm hook: record the interval from its call to the completion of its future."""

    def wrapped(state: Any, bucket: Any) -> torch.futures.Future:
        start = time.perf_counter()
        future = hook(state, bucket)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            timer.add(start, time.perf_counter())
            return fut.value()

        return future.then(done)

    # DDP checks the hook's annotations; this module's are strings (``from __future__ import annotations``)
    wrapped.__annotations__ = dict(hook.__annotations__)
    return wrapped


def _time_bagua_buckets(model: torch.nn.Module, timer: _IntervalTimer) -> None:
    """Record each bucket's communication as an interval: a bucket run on the engine's comm thread from the
    start to the end of ``execute()``, a bucket launched directly as one async collective (``async_launcher``)
    from the launch to the completion of its future. Buckets are rebuilt when an algorithm resets, so this runs
    before every step and wraps only buckets it has not wrapped yet. It instruments this benchmark's own bucket
    objects, nothing of torch."""
    for bucket in model.bagua_ddp.bagua_buckets:
        if getattr(bucket, "_bench_timed", False):
            continue
        execute, async_launcher = bucket.execute, bucket.async_launcher

        def timed_execute(execute=execute) -> None:
            start = time.perf_counter()
            try:
                execute()
            finally:
                timer.add(start, time.perf_counter())

        def timed_async_launcher(async_launcher=async_launcher) -> Optional[Callable]:
            launch = async_launcher()
            if launch is None:
                return None

            def timed_launch(b: Any, flat: torch.Tensor) -> Any:
                start = time.perf_counter()
                handle = launch(b, flat)
                work = getattr(handle, "work", handle)  # bucket.AsyncHandle holds the torch Work
                if work is not None and hasattr(work, "get_future"):
                    work.get_future().then(lambda fut: timer.add(start, time.perf_counter()))
                return handle

            return timed_launch

        bucket.execute = timed_execute
        bucket.async_launcher = timed_async_launcher
        bucket._bench_timed = True


def untimed_steps(system: str, requested: int, qadam_warmup: int) -> int:
    """Steps to leave untimed: at least ``requested``, and past a system's own start-up phase (PowerSGD's two
    vanilla allreduces and first factorization; QAdam's full-precision warmup and its switch step; post-local
    SGD's plain-DDP warmup), so that the timed steps measure the system in its steady state. ``system`` is a
    spec, options included."""
    name, kwargs = split_system(system)
    if name == "ddp_powersgd":
        return max(requested, 3)
    if name == "qadam":
        return max(requested, qadam_warmup + 1)
    if name == "ddp_post_local_sgd":
        return max(requested, int(kwargs.get("warmup", POST_LOCAL_SGD_DEFAULTS["warmup"])))
    return requested


def steps_per_round(spec: str) -> int:
    """Steps between a system's communication rounds (a local-update period): timed runs should cover whole
    rounds, and their mean step, not the median, is the cost of a step."""
    name, kwargs = split_system(spec)
    if name == "ddp_post_local_sgd":
        return int(kwargs.get("period", POST_LOCAL_SGD_DEFAULTS["period"]))
    if name in ("diloco", "torchft_diloco"):
        from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm

        return int(kwargs.get("sync_every", DiLoCoAlgorithm.sync_every))
    return int(kwargs.get("communication_interval", 1))


def qadam_warmup_steps(total_steps: Optional[int], timed_steps: int) -> int:
    """QAdam's full-precision warmup: 20 % of the run, the 1-bit Adam paper's advice, and at least 2 steps (its
    frozen variance is the average of the warmup's squared gradients: one step gives a poor denominator).

    ``total_steps`` is the run's length when it is fixed (digits: its epochs); ``None`` for the synthetic
    models, whose run is the warmup, the switch step and ``timed_steps`` timed steps, so the warmup is the
    smallest ``W`` with ``W >= 0.2 * (W + 1 + timed_steps)``."""
    if total_steps is not None:
        return max(2, total_steps // 5)
    return max(2, -(-(timed_steps + 1) // 4))


def _post_local_sgd(model: torch.nn.Module, optimizer_kind: str, lr: float, timer: _IntervalTimer,
                    period: int = POST_LOCAL_SGD_DEFAULTS["period"],
                    warmup: int = POST_LOCAL_SGD_DEFAULTS["warmup"]) -> System:
    """torch's post-local SGD (Lin et al., https://arxiv.org/abs/1808.07217): DDP allreduces gradients for
    ``warmup`` steps (``PostLocalSGDState.start_localSGD_iter``), then every rank steps on its own gradient and a
    ``PeriodicModelAverager`` averages the weights after every ``period``-th optimizer step (an optimizer step
    post hook). With one rank per host there is no intra-node gradient allreduce to keep
    (``post_local_gradient_allreduce=False``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.nn.parallel import DistributedDataParallel as DDP

    if period < 1 or warmup < 1:
        raise ValueError(f"ddp_post_local_sgd: period ({period}) and warmup ({warmup}) must be at least 1 "
                         "(torch's hook needs a first step of plain allreduce)")
    ddp = DDP(model)
    state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup,
                                                 post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, _timed_hook(post_localSGD_hook.post_localSGD_hook, timer))
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
    optimizer = _make_optimizer(optimizer_kind, ddp.parameters(), lr)

    def average(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        start = time.perf_counter()
        averager.average_parameters(ddp.parameters())
        timer.add(start, time.perf_counter())

    handle = optimizer.register_step_post_hook(average)
    return System(ddp, optimizer, ddp.no_sync, timer, close=handle.remove,
                  notes=[f"post-local SGD: plain DDP for {warmup} steps, then weights averaged every {period} steps"])


def make_system(name: str, model: torch.nn.Module, optimizer_kind: str, lr: float, qadam_warmup: int) -> System:
    """Wrap ``model`` for ``name`` (a DDP variant or a Bagua algorithm name) and build its optimizer;
    ``qadam_warmup`` is QAdam's number of full-precision steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    timer = _IntervalTimer()
    name, kwargs = split_system(name)
    inner_kind = kwargs.pop("inner", None)  # e.g. diloco:inner=muon (INNER_OPTIMIZERS)
    if inner_kind is not None and name != "ddp" and (name in DDP_SYSTEMS or name in ("qadam", "torchft_diloco")):
        raise ValueError(f"{name}: inner= is supported by ddp and Bagua's algorithms except qadam")
    kind = inner_kind or optimizer_kind
    inner_notes = [f"inner optimizer {inner_kind}"] if inner_kind else []
    if name == "ddp_post_local_sgd":
        return _post_local_sgd(model, optimizer_kind, lr, timer, **kwargs)
    if name == "torchft_diloco":  # an optional peer: torchft's DiLoCo (benchmarks.to_target.torchft_peer)
        from benchmarks.to_target import torchft_peer
        inner, close, note = torchft_peer.torchft_diloco(
            model, lambda params: _make_optimizer(optimizer_kind, params, lr), **kwargs)
        return System(model, inner, contextlib.nullcontext, None, close=close, notes=[note])
    if kwargs and name in DDP_SYSTEMS and name != "ddp_bytegrad":
        raise ValueError(f"{name} takes no extra arguments in this benchmark, got {kwargs}")
    if name in DDP_SYSTEMS:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        # torch's powerSGD_hook waits for a collective inside a future callback; on gloo two buckets in flight
        # block both of gloo's worker threads and the step deadlocks, so PowerSGD gets one bucket
        ddp = DDP(model, bucket_cap_mb=1024) if name == "ddp_powersgd" else DDP(model)
        notes: list[str] = list(inner_notes)
        if name == "ddp":
            timer = None
        elif name == "ddp_fp16":
            ddp.register_comm_hook(None, _timed_hook(default_hooks.fp16_compress_hook, timer))
        elif name == "ddp_bf16":  # float32's exponent range: no gradient flushes to zero, 8 bits of mantissa
            ddp.register_comm_hook(None, _timed_hook(default_hooks.bf16_compress_hook, timer))
        elif name == "ddp_bytegrad":  # Bagua's ByteGrad as a comm hook on plain DDP (docs/integrations.md)
            from bagua.torch_api.contrib.ddp_hooks import ByteGradState, bytegrad_hook

            state = ByteGradState(**kwargs)  # e.g. ddp_bytegrad:codec=uint8:error_feedback=True
            ddp.register_comm_hook(state, _timed_hook(bytegrad_hook, timer))
            return System(ddp, _make_optimizer(optimizer_kind, ddp.parameters(), lr), ddp.no_sync, timer,
                          close=state.close, notes=["ByteGrad as a DDP comm hook (contrib.ddp_hooks.bytegrad_hook)"])
        else:
            # start_powerSGD_iter must be > 1 (DDP rebuilds its buckets after the first iteration)
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, _timed_hook(powerSGD_hook.powerSGD_hook, timer))
            notes.append("PowerSGD rank 1, error feedback, one bucket; its 2 vanilla allreduce steps are untimed")
        return System(ddp, _build_optimizer(kind, model, lr), ddp.no_sync, timer, notes=notes)

    from bagua.torch_api.algorithms import Algorithm, GlobalAlgorithmRegistry

    load_algorithm_modules()
    notes = list(inner_notes)
    if name == "qadam":
        from bagua.torch_api.algorithms.q_adam import QAdamOptimizer

        optimizer = QAdamOptimizer(model.parameters(), lr=lr if optimizer_kind == "adam" else 1e-3,
                                   warmup_steps=qadam_warmup)
        algorithm = GlobalAlgorithmRegistry.get("qadam")(optimizer, **kwargs)  # e.g. qadam:codec=uint8
        notes.append(f"QAdamOptimizer, warmup_steps={qadam_warmup}")
    else:
        optimizer = _build_optimizer(kind, model, lr)
        algorithm = Algorithm.init(name, **kwargs)
    model = model.with_bagua(optimizer.optimizers if isinstance(optimizer, _Optimizers) else [optimizer],
                             algorithm)

    def close() -> None:
        impl = model.bagua_ddp.impl
        if hasattr(impl, "abort"):  # async model averaging runs a background thread
            impl.abort(model)
        model.bagua_ddp.close()

    return System(model, optimizer, model.bagua_ddp.no_sync, timer,
                  before_step=lambda: _time_bagua_buckets(model, timer), close=close, notes=notes)

