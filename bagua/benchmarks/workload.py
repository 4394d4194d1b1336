"""The training job each emulated host runs: ``python -m bagua.benchmarks.workload --system S --model M ...``.

One process per host, described by the usual launcher variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``) plus ``GLOO_SOCKET_IFNAME``. It trains ``--model``
with ``--system`` and writes one JSON file per rank (``<out>.rank<r>.json``) with:

- ``step_times_s``: wall time of every timed step (zero_grad + forward + backward + communication + optimizer
  step), warm-up steps excluded;
- ``tx_bytes``: bytes the host's interface sent during the timed steps (``/proc/net/dev``);
- ``compute_step_s``: median step of an *unwrapped* replica of the model (same data, same optimizer type, no
  communication), measured right after the timed steps on every rank at once: the compute phase;
- ``comm_busy_s``: per timed step, the time during which communication operations were running (the union of
  Bagua bucket executions, or of DDP comm-hook futures; ``None`` for plain DDP, whose C++ allreduce cannot be
  timed from outside);
- ``codec_s``: per step, the estimated compression cost (encode/decode of the gradient-sized tensor with the
  algorithm's codec, timed in-process);
- ``accuracy`` / ``final_loss`` for the digits models.

Models (:data:`MODELS`): ``mlp`` (synthetic, communication-heavy), ``digits`` (small CNN) and ``resnet`` (BatchNorm
ResNet, :mod:`bagua.benchmarks.resnet`) on scikit-learn's digits, ``gpt`` (byte-level GPT on the standard
library's sources, :mod:`bagua.benchmarks.gpt`), and ``tiny``, ``resnet_tiny``, ``gpt_tiny`` for tests.

With ``--target T`` the job instead trains until the validation metric reaches ``T`` (or ``--max-steps``) and
adds ``to_target`` to its result (:mod:`bagua.benchmarks.to_target`).

Systems: ``ddp``, ``ddp_fp16`` (``fp16_compress_hook``), ``ddp_powersgd`` (``powerSGD_hook``, rank 1, vanilla
allreduce in the first step as torch requires), and every name in Bagua's algorithm registry (``qadam`` gets its
own ``QAdamOptimizer``).

Example::

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \\
        python -m bagua.benchmarks.workload --system gradient_allreduce --model tiny --steps 2 --out /tmp/r
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist

from bagua.benchmarks.models import MODELS, build_model
from bagua.benchmarks.models import loss_fn as _loss_fn
from bagua.benchmarks.models import train_batches as _batches

__all__ = ["MODELS", "DDP_SYSTEMS", "CODEC_PASSES", "available_systems", "split_system", "build_model", "main"]

DDP_SYSTEMS = ("ddp", "ddp_fp16", "ddp_powersgd")

#: Compression work per step, in passes over the gradient: ``(encodes, decodes)`` of MinMaxUInt8 as a function
#: of the world size ``n`` (ByteGrad/QAdam: encode all, decode all n received chunks, encode the reduced chunk,
#: decode the gathered result), or a cast round trip for fp16.
CODEC_PASSES: dict[str, Callable[[int], tuple[float, float]]] = {
    "bytegrad": lambda n: (1 + 1 / n, 2.0),
    "qadam": lambda n: (1 + 1 / n, 2.0),
    "low_precision_decentralized": lambda n: (1.0, 2.0),
    "ddp_fp16": lambda n: (1.0, 1.0),
}


# -- systems -------------------------------------------------------------------------------------------------


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
    """``ddp``, ``ddp_fp16``, ``ddp_powersgd``, then every registered Bagua algorithm name."""
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
    optimizer: torch.optim.Optimizer
    no_sync: Callable[[], ContextManager]
    timer: Optional[_IntervalTimer]
    before_step: Callable[[], None] = lambda: None
    close: Callable[[], None] = lambda: None
    notes: list[str] = field(default_factory=list)


def _make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr) if kind == "adam" else torch.optim.SGD(params, lr=lr)


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
    vanilla allreduces and first factorization; QAdam's full-precision warmup and its switch step), so that the
    timed steps measure the system in its steady state."""
    if system == "ddp_powersgd":
        return max(requested, 3)
    if system == "qadam":
        return max(requested, qadam_warmup + 1)
    return requested


def qadam_warmup_steps(total_steps: Optional[int], timed_steps: int) -> int:
    """QAdam's full-precision warmup: 20 % of the run, the 1-bit Adam paper's advice, and at least 2 steps (its
    frozen variance is the average of the warmup's squared gradients: one step gives a poor denominator).

    ``total_steps`` is the run's length when it is fixed (digits: its epochs); ``None`` for the synthetic
    models, whose run is the warmup, the switch step and ``timed_steps`` timed steps, so the warmup is the
    smallest ``W`` with ``W >= 0.2 * (W + 1 + timed_steps)``."""
    if total_steps is not None:
        return max(2, total_steps // 5)
    return max(2, -(-(timed_steps + 1) // 4))


def make_system(name: str, model: torch.nn.Module, optimizer_kind: str, lr: float, qadam_warmup: int) -> System:
    """Wrap ``model`` for ``name`` (a DDP variant or a Bagua algorithm name) and build its optimizer;
    ``qadam_warmup`` is QAdam's number of full-precision steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    timer = _IntervalTimer()
    name, kwargs = split_system(name)
    if kwargs and (name in DDP_SYSTEMS or name == "qadam"):
        raise ValueError(f"{name} takes no extra arguments in this benchmark, got {kwargs}")
    if name in DDP_SYSTEMS:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        # torch's powerSGD_hook waits for a collective inside a future callback; on gloo two buckets in flight
        # block both of gloo's worker threads and the step deadlocks, so PowerSGD gets one bucket
        ddp = DDP(model, bucket_cap_mb=1024) if name == "ddp_powersgd" else DDP(model)
        notes: list[str] = []
        if name == "ddp":
            timer = None
        elif name == "ddp_fp16":
            ddp.register_comm_hook(None, _timed_hook(default_hooks.fp16_compress_hook, timer))
        else:
            # start_powerSGD_iter must be > 1 (DDP rebuilds its buckets after the first iteration)
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, _timed_hook(powerSGD_hook.powerSGD_hook, timer))
            notes.append("PowerSGD rank 1, error feedback, one bucket; its 2 vanilla allreduce steps are untimed")
        return System(ddp, _make_optimizer(optimizer_kind, ddp.parameters(), lr), ddp.no_sync, timer, notes=notes)

    from bagua.torch_api.algorithms import Algorithm, GlobalAlgorithmRegistry

    load_algorithm_modules()
    notes = []
    if name == "qadam":
        from bagua.torch_api.algorithms.q_adam import QAdamOptimizer

        optimizer = QAdamOptimizer(model.parameters(), lr=lr if optimizer_kind == "adam" else 1e-3,
                                   warmup_steps=qadam_warmup)
        algorithm = GlobalAlgorithmRegistry.get("qadam")(optimizer)
        notes.append(f"QAdamOptimizer, warmup_steps={qadam_warmup}")
    else:
        optimizer = _make_optimizer(optimizer_kind, model.parameters(), lr)
        algorithm = Algorithm.init(name, **kwargs)
    model = model.with_bagua([optimizer], algorithm)

    def close() -> None:
        impl = model.bagua_ddp.impl
        if hasattr(impl, "abort"):  # async model averaging runs a background thread
            impl.abort(model)
        model.bagua_ddp.close()

    return System(model, optimizer, model.bagua_ddp.no_sync, timer,
                  before_step=lambda: _time_bagua_buckets(model, timer), close=close, notes=notes)


# -- measurements --------------------------------------------------------------------------------------------


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, x, y) -> float:
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _median_compute_step(replica: torch.nn.Module, optimizer_kind: str, lr: float, loss_fn: Callable,
                         batches: list, n: int) -> float:
    optimizer = _make_optimizer(optimizer_kind, replica.parameters(), lr)
    times = []
    for i in range(n + 1):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        _step(replica, optimizer, loss_fn, x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _codec_seconds(system: str, numel: int, world: int, repeats: int = 2) -> Optional[float]:
    """Estimated compression seconds per step for ``system`` (see :data:`CODEC_PASSES`)."""
    if system not in CODEC_PASSES:
        return 0.0 if system in ("ddp", "gradient_allreduce", "decentralized", "async") else None
    encodes, decodes = CODEC_PASSES[system](world)
    x = torch.randn(numel)
    if system == "ddp_fp16":
        enc = _best_of(lambda: x.half(), repeats)
        half = x.half()
        dec = _best_of(lambda: half.float(), repeats)
    else:
        from bagua.torch_api import compression

        rows = max(world, 1)
        length = -(-numel // rows)
        xs = torch.zeros(rows * length)
        xs[:numel] = x
        xs = xs.view(rows, length)
        wire = compression.wire_buffer(rows, length)
        out = torch.empty_like(xs)
        enc = _best_of(lambda: compression.encode_chunks(xs, wire), repeats)
        dec = _best_of(lambda: compression.decode_chunks(wire, out), repeats)
    return encodes * enc + decodes * dec


def _best_of(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _evaluate(model: torch.nn.Module, test: tuple) -> float:
    x_te, y_te = test
    was_training = model.training
    model.eval()
    with torch.no_grad():
        acc = float((model(x_te).argmax(dim=1) == y_te).float().mean())
    model.train(was_training)
    return acc


# -- main ----------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the workload's arguments."""
    p = argparse.ArgumentParser(prog="python -m bagua.benchmarks.workload", description=__doc__.splitlines()[0])
    p.add_argument("--system", required=True, help="ddp, ddp_fp16, ddp_powersgd or a Bagua algorithm name")
    p.add_argument("--model", default="mlp", choices=sorted(MODELS))
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=5, help="timed steps (synthetic models)")
    p.add_argument("--epochs", type=int, default=6, help="epochs (digits); every step after --warmup is timed")
    p.add_argument("--batch-size", type=int, default=None, help="per-rank batch size (default: the model's, "
                                                                  "32; gpt: 8 sequences)")
    p.add_argument("--lr", type=float, default=None, help="default: 0.01 (SGD), 0.002 (Adam, digits), "
                                                          "0.001 (Adam, gpt)")
    p.add_argument("--target", type=float, default=None, help="train to this validation metric instead of timing "
                                                              "steps (bagua.benchmarks.to_target)")
    p.add_argument("--eval-every", type=int, default=None, help="with --target: steps between evaluations "
                                                                 "(default: the model's, to_target.DEFAULTS)")
    p.add_argument("--eval-samples", type=int, default=None, help="with --target: validation windows (gpt) or "
                                                                   "test images (0: all 360) evaluated")
    p.add_argument("--max-steps", type=int, default=None, help="with --target: give up after this many steps")
    p.add_argument("--qadam-warmup", type=int, default=None, help="with --target: QAdam's warmup steps")
    p.add_argument("--compute-steps", type=int, default=3, help="replica steps for the compute phase (0: skip)")
    p.add_argument("--iface", default="lo", help="interface whose tx bytes are counted")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="results go to OUT.rank<r>.json")
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = MODELS[args.model].batch_size
    for key in ("warmup", "steps", "epochs", "batch_size", "threads", "eval_every", "max_steps"):
        if getattr(args, key) is not None and getattr(args, key) < (0 if key == "warmup" else 1):
            raise ValueError(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the job on this host; write and return this rank's result."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import bagua.torch_api as bagua
    from bagua.benchmarks.netns import read_tx_bytes

    bagua.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.target is not None:
        from bagua.benchmarks import to_target

        return _write(args, to_target.train(args, rank, world))
    spec = MODELS[args.model]
    optimizer_kind = spec.optimizer
    lr = args.lr if args.lr is not None else spec.lr
    qadam_warmup = qadam_warmup_steps(len(_batches(args, rank, world)[0]) if spec.data == "digits" else None,
                                      args.steps)
    args.warmup = untimed_steps(split_system(args.system)[0], args.warmup, qadam_warmup)
    batches, test = _batches(args, rank, world)
    if len(batches) <= args.warmup:
        raise ValueError(f"{len(batches)} steps in total but --warmup={args.warmup}: add epochs or steps")
    model = build_model(args.model, args.seed)
    replica = copy.deepcopy(model) if args.compute_steps else None
    numel = sum(p.numel() for p in model.parameters())
    system = make_system(args.system, model, optimizer_kind, lr, qadam_warmup)
    loss_fn = _loss_fn(spec)

    times, losses, tx_start, comm_busy = [], [], 0, 0.0
    train_start = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        if i == args.warmup:
            dist.barrier()
            tx_start = read_tx_bytes(args.iface)
            if system.timer is not None:
                system.timer.take()
        system.before_step()
        start = time.perf_counter()
        losses.append(_step(system.model, system.optimizer, loss_fn, x, y))
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    tx_bytes = read_tx_bytes(args.iface) - tx_start
    if system.timer is not None:
        comm_busy = system.timer.take()
    train_time = time.perf_counter() - train_start
    system.close()
    accuracy = _evaluate(system.model, test) if test is not None else None

    dist.barrier()  # every rank measures compute and the codec at the same time, as in training
    compute = (_median_compute_step(replica, optimizer_kind, lr, loss_fn, batches, args.compute_steps)
               if replica is not None else None)
    codec = _codec_seconds(split_system(args.system)[0], numel, world)
    result = {
        "rank": rank, "world_size": world, "system": args.system, "model": args.model, "params": numel,
        "batch_size": args.batch_size, "warmup": args.warmup, "timed_steps": len(times),
        "step_times_s": times, "median_step_s": statistics.median(times), "tx_bytes": tx_bytes,
        "iface": args.iface, "compute_step_s": compute, "codec_s": codec,
        "comm_busy_s": comm_busy / len(times) if system.timer is not None else None,
        "accuracy": accuracy, "final_loss": statistics.mean(losses[-5:]), "train_time_s": train_time,
        "notes": system.notes,
    }
    return _write(args, result)


def _write(args: argparse.Namespace, result: dict) -> dict:
    """Write this rank's result, wait for every rank, leave the process group; return the result."""
    with open(f"{args.out}.rank{result['rank']}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
