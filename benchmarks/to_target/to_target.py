"""Time to accuracy: train every system until a validation metric reaches a target (``bagua-bench --to-target``).

Step speed alone hides what compression and decentralization cost in convergence. In this mode each run trains
until the metric reaches the target, and reports how long that took:

- the *metric*: validation loss of the language model (``gpt``; lower is better) on a fixed subset of
  ``--eval-samples`` windows of the validation files, or test accuracy of the digits classifiers (``resnet``,
  ``digits``; higher is better) on the held-out 20 % (or its first ``--eval-samples`` images);
- it is measured every ``--eval-every`` steps (and once before the first), by every rank on a copy of its own
  weights (decentralized and async ranks hold different models), and the ranks' values are averaged with one
  allreduce, so all ranks stop at the same step;
- *time to target*: wall time from the start of training until the evaluation that reached the target, with the
  evaluations' own time taken out (the slowest rank's); *wall to target* keeps it in; *steps to target* is that
  evaluation's step, so it is exact to within ``--eval-every`` steps;
- the budget: DDP trains for at most ``--max-steps``; every other system, in the same suite run, model, host
  count and bandwidth, for at most 3x the steps DDP needed (3x the steps it ran when it missed the target). A run
  that exhausts its budget is reported as ``not reached``, with its final metric, and never dropped.

The plot (:func:`benchmarks.common.plots.plot_to_target`) draws the metric against time to target, one panel per
bandwidth. :func:`train` is the loop each host runs (called by :mod:`benchmarks.common.workload`);
:func:`summarize`, :func:`step_budget`, :func:`add_time_speedups` and :func:`format_table` are the suite's side.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["Defaults", "DEFAULTS", "BUDGET_FACTOR", "reached", "train", "summarize", "step_budget",
           "add_time_speedups", "format_table", "COLUMNS"]

#: a system's step budget is this many times the steps DDP needed
BUDGET_FACTOR = 3


@dataclass(frozen=True)
class Defaults:
    """A model's time-to-accuracy settings: the target, evaluation interval and size, and DDP's step budget."""

    target: float
    eval_every: int
    eval_samples: int
    max_steps: int


#: gpt: the validation loss DDP on 2 hosts reaches at step 500 (2.42 at 450, 2.38 at 500, on 64 windows), well
#: past the unigram plateau (3.25), evaluated every 50 steps (under 5 % of a run); resnet: test accuracy first
#: reached at step 70, its curve saturates by step 140 (docs/benchmarks_method.md, "Targets").
DEFAULTS: dict[str, Defaults] = {
    "gpt": Defaults(target=2.40, eval_every=50, eval_samples=64, max_steps=1500),
    "resnet": Defaults(target=0.98, eval_every=10, eval_samples=0, max_steps=2000),
    "digits": Defaults(target=0.97, eval_every=10, eval_samples=0, max_steps=2000),
    "gpt_tiny": Defaults(target=4.5, eval_every=2, eval_samples=8, max_steps=60),
    "resnet_tiny": Defaults(target=0.5, eval_every=2, eval_samples=0, max_steps=60),
}


def reached(metric: float, target: float, higher_is_better: bool) -> bool:
    """Whether ``metric`` is at or past ``target`` in the metric's good direction."""
    return metric >= target if higher_is_better else metric <= target


# -- the loop each host runs ---------------------------------------------------------------------------------


def _digits_stream(args: argparse.Namespace, rank: int, world: int) -> tuple[Callable, tuple]:
    from benchmarks.common.models import _digits_split, digits_epoch_batches

    x_tr, y_tr, x_te, y_te = _digits_split(0)  # one held-out set for every seed: the target is calibrated on it
    cache: dict[int, list] = {}

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_epoch = len(x_tr) // world // args.batch_size
        epoch = i // per_epoch
        if epoch not in cache:
            cache.clear()
            cache[epoch] = digits_epoch_batches(x_tr, y_tr, args.batch_size, rank, world, args.seed, epoch)
        return cache[epoch][i % per_epoch]

    n = args.eval_samples or len(x_te)
    return batch, (x_te[:n], y_te[:n])


def _text_stream(args: argparse.Namespace, rank: int, block_size: int) -> tuple[Callable, tuple]:
    from benchmarks.common.gpt import TextBatches, validation_windows
    from benchmarks.common.models import _text

    train_data, val_data = _text(args.model)
    stream = TextBatches(train_data, args.batch_size, block_size, args.seed, rank)
    return stream.batch, validation_windows(val_data, args.eval_samples, block_size)


def _metric(replica: torch.nn.Module, data: tuple, classify: bool) -> float:
    from benchmarks.common.gpt import lm_loss

    x, y = data
    replica.eval()
    with torch.no_grad():
        out = replica(x)
        return float((out.argmax(dim=1) == y).float().mean()) if classify else float(lm_loss(out, y))


def _mean_over_ranks(value: float, world: int) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)  # the default group: the engines communicate in groups of their own
    return float(t) / world


def train(args: argparse.Namespace, rank: int, world: int) -> dict:
    """Train ``args.model`` with ``args.system`` until the averaged metric reaches ``args.target`` or
    ``args.max_steps`` steps have run; return this rank's result (the workload's keys plus ``to_target``)."""
    from benchmarks.common.netns import read_tx_bytes
    from benchmarks.common.models import MODELS, build_model
    from benchmarks.common.measurements import _codec_seconds, _step
    from benchmarks.common.systems import make_system, split_system

    spec = MODELS[args.model]
    if args.model not in DEFAULTS:
        raise ValueError(f"--target needs a model with validation data ({', '.join(DEFAULTS)}), "
                         f"not {args.model!r}")
    defaults = DEFAULTS[args.model]
    for key in ("eval_every", "eval_samples", "max_steps"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(defaults, key))
    lr = args.lr if args.lr is not None else spec.lr
    batch, val = (_digits_stream(args, rank, world) if spec.data == "digits"
                  else _text_stream(args, rank, spec.in_shape[0]))
    loss_fn = torch.nn.functional.cross_entropy if spec.classify else _lm_loss()
    model = build_model(args.model, args.seed)
    replica = copy.deepcopy(model)  # evaluated on a copy: a wrapped model's forward may communicate
    numel = sum(p.numel() for p in model.parameters())
    qadam_warmup = args.qadam_warmup or max(2, args.max_steps // (5 * BUDGET_FACTOR))
    system = make_system(args.system, model, spec.optimizer, lr, qadam_warmup)
    module = getattr(system.model, "module", system.model)  # DDP keeps the model as .module

    def evaluate() -> float:
        replica.load_state_dict(module.state_dict())
        return _mean_over_ranks(_metric(replica, val, spec.classify), world)

    dist.barrier()
    tx_start = read_tx_bytes(args.iface)
    if system.timer is not None:
        system.timer.take()
    start = time.perf_counter()
    eval_s, times, losses = 0.0, [], []
    metric = evaluate()
    eval_s += time.perf_counter() - start
    curve = [[0, 0.0, eval_s, metric]]
    hit = reached(metric, args.target, spec.classify)
    step = 0
    while not hit and step < args.max_steps:
        x, y = batch(step)
        system.before_step()
        t0 = time.perf_counter()
        losses.append(_step(system.model, system.optimizer, loss_fn, x, y))
        times.append(time.perf_counter() - t0)
        step += 1
        if step % args.eval_every == 0 or step == args.max_steps:
            e0 = time.perf_counter()
            metric = evaluate()
            now = time.perf_counter()
            eval_s += now - e0
            curve.append([step, now - start - eval_s, now - start, metric])
            hit = reached(metric, args.target, spec.classify)
    tx_bytes = read_tx_bytes(args.iface) - tx_start
    comm_busy = system.timer.take() if system.timer is not None else None
    system.close()
    steps_run, train_s, wall_s = curve[-1][0], curve[-1][1], curve[-1][2]
    return {
        "rank": rank, "world_size": world, "system": args.system, "model": args.model, "params": numel,
        "batch_size": args.batch_size, "warmup": 0, "timed_steps": max(len(times), 1),
        "step_times_s": times or [0.0], "median_step_s": statistics.median(times) if times else 0.0,
        "tx_bytes": tx_bytes, "iface": args.iface, "compute_step_s": None,
        "codec_s": _codec_seconds(split_system(args.system)[0], numel, world),
        "comm_busy_s": comm_busy / max(len(times), 1) if comm_busy is not None else None,
        "accuracy": metric if spec.classify else None,
        "final_loss": statistics.mean(losses[-5:]) if losses else None, "train_time_s": train_s,
        "notes": system.notes + ([f"QAdam warmup {qadam_warmup} steps"] if args.system == "qadam" else []),
        "to_target": {
            "metric": "accuracy" if spec.classify else "val_loss", "higher_is_better": spec.classify,
            "target": args.target, "reached": hit, "steps_to_target": steps_run if hit else None,
            "time_to_target_s": train_s if hit else None, "wall_to_target_s": wall_s if hit else None,
            "final_metric": metric, "steps_run": steps_run, "step_budget": args.max_steps,
            "eval_every": args.eval_every, "eval_s": eval_s, "train_s": train_s, "wall_s": wall_s,
            "curve": curve,
        },
    }


def _lm_loss() -> Callable:
    from benchmarks.common.gpt import lm_loss

    return lm_loss


# -- the suite's side ----------------------------------------------------------------------------------------

#: result columns this mode adds to the JSON and CSV
COLUMNS = ["metric", "target", "target_status", "steps_to_target", "time_to_target_s", "wall_to_target_s",
           "final_metric", "steps_run", "step_budget", "eval_every", "eval_s", "time_speedup"]


def summarize(ranks: list[dict]) -> dict:
    """The to-target columns of one run from its ranks' results: the slowest rank's times; steps and the
    (averaged) metric are the same on every rank."""
    tts = [r["to_target"] for r in ranks]
    first = tts[0]
    hit = first["reached"]
    return {
        "metric": first["metric"], "target": first["target"],
        "target_status": "reached" if hit else "not reached",
        "steps_to_target": first["steps_to_target"],
        "time_to_target_s": max(t["time_to_target_s"] for t in tts) if hit else None,
        "wall_to_target_s": max(t["wall_to_target_s"] for t in tts) if hit else None,
        "final_metric": first["final_metric"], "steps_run": first["steps_run"], "step_budget": first["step_budget"],
        "eval_every": first["eval_every"], "eval_s": max(t["eval_s"] for t in tts),
        "train_s": max(t["train_s"] for t in tts), "curve": first["curve"],
    }


def step_budget(ddp_row: Optional[dict], max_steps: int,
                factor: float = BUDGET_FACTOR) -> tuple[int, Optional[int]]:
    """(step budget, QAdam warmup) of a non-DDP system given DDP's row of the same configuration: ``factor`` (3)
    times the steps DDP needed (or ran, when it missed), QAdam warming up for 20 % of DDP's steps; without a
    successful DDP row, ``max_steps`` and the workload's default warmup."""
    if ddp_row is None or ddp_row.get("status") != "ok" or not ddp_row.get("steps_run"):
        return max_steps, None
    ddp_steps = ddp_row["steps_to_target"] or ddp_row["steps_run"]
    return int(factor * ddp_steps), max(2, ddp_steps // 5)


def add_time_speedups(rows: list[dict]) -> list[dict]:
    """Add ``time_speedup`` (DDP's time to target / the system's) where both reached the target."""

    def key(r: dict) -> tuple:
        return (r.get("run"), r.get("repeat"), r.get("seed"), r.get("phase"), r["model"], r["hosts"], r["bandwidth"])

    ddp = {key(r): r["time_to_target_s"] for r in rows
           if r["system"] == "ddp" and r.get("status") == "ok" and r.get("time_to_target_s")}
    for r in rows:
        if "target_status" not in r:
            continue
        base, mine = ddp.get(key(r)), r.get("time_to_target_s")
        r["time_speedup"] = base / mine if base and mine else None
    return rows


def format_table(rows: list[dict]) -> str:
    """A fixed-width table of the to-target rows: steps, time and final metric per system and bandwidth."""
    head = ["model", "hosts", "bandwidth", "system", "target", "steps", "time s", "wall s", "final", "vs DDP",
            "result"]
    lines = [head]
    for r in rows:
        if "target_status" not in r and r.get("status") == "ok":
            continue
        ok = r.get("status") == "ok"
        hit = ok and r["target_status"] == "reached"
        fmt = (lambda v, spec: "-" if v is None else format(v, spec))
        lines.append([
            r["model"], str(r["hosts"]), r["bandwidth"], r["system"],
            f"{r.get('metric', '')} {'>=' if r.get('metric') == 'accuracy' else '<='} {r.get('target')}",
            (str(r["steps_to_target"]) if hit else f">{r['steps_run']}") if ok else "-",
            fmt(r.get("time_to_target_s"), ".1f"), fmt(r.get("wall_to_target_s"), ".1f"),
            fmt(r.get("final_metric"), ".3f"), fmt(r.get("time_speedup"), ".2f"),
            r["target_status"] if ok else r.get("status", "?"),
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in lines]
    text.insert(1, "-" * len(text[0]))
    text.append("time = training wall time to the target, evaluations excluded (wall: included); "
                "budget: --max-steps for DDP, --budget-factor (default "
                f"{BUDGET_FACTOR}) x DDP's steps for the others")
    return "\n".join(text)
