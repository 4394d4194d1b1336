"""Steps to the target with the exchange overlapped: no overlap, Streaming DiLoCo's merge, eager updates.

A one-process simulation of ``M`` DiLoCo workers on CPU: each worker trains its own copy of a small byte-level GPT
(:mod:`benchmarks.common.gpt`, 2 layers, width 64, context 64; the benchmark's text and batches of 8 windows per
worker and step, Adam at 3e-3) and owns one :class:`~bagua.torch_api.ops.diloco.Fragment` per fragment, the
library's: its pseudo-gradient, its outer step (the warmed-up Nesterov step ``"auto"`` gives at ``H = 10``: lr 1.0,
momentum 0.5, warmed up over 10 outer steps), the merge and the eager step are the code the library runs. The
exchange is the exact float32 mean of the workers' pseudo-gradients, handed to each worker ``tau`` inner steps after
it starts (the driver's schedule: a fragment's exchange starts after the steps ``s % H == offset``, its outer step
lands ``tau`` steps later, a finishing exchange before a starting one). Steps do not depend on the link, so no
link is simulated.

The metric is the benchmark's (``benchmarks.to_target``): every ``--eval-every`` steps, the validation loss of each
worker's own weights, averaged over the workers; the global weights' loss is recorded beside it. The figure is the
first evaluated step at which the metric reaches ``--target``.

    .venv/bin/python -m benchmarks.to_target.eager_overlap --workers 4 8 --seeds 0 1 2 \\
        --modes none merge eager --json docs/log/results/eager-updates.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import torch

from bagua.torch_api.ops.diloco import Fragment, due_fragments, split_fragments, sync_offsets
from bagua.torch_api.ops.diloco_outer import auto_outer

__all__ = ["simulate", "steps_to", "summarize", "MODES"]

#: what happens while an exchange travels: ``none`` (nothing: it is waited for at once), ``merge`` (today's
#: ``overlap_steps``: ``x = alpha x + (1 - alpha) g`` on arrival), ``eager`` (``eager=True``: this worker's own
#: pseudo-gradient stands in for the average); other stand-ins, measured once and not in the library:
#: ``eager-paper`` (own / M + (M - 1) / M x the last average), ``eager-prev`` (the last average), ``eager-zero``
#: (nothing: the momentum alone), ``eager-own`` (own / M), ``eager-oracle`` (the average itself: no overlap's maths)
MODES = ("none", "merge", "eager", "eager-paper", "eager-prev", "eager-zero", "eager-own", "eager-oracle")


def _model(seed: int, width: int) -> torch.nn.Module:
    from benchmarks.common.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=width))


def simulate(workers: int, mode: str, seed: int, H: int = 10, tau: int = 5, fragments: int = 1, steps: int = 400,
             eval_every: int = 20, target: float = 0.0, alpha: float = 0.5, width: int = 64,
             eval_windows: int = 64, text: Optional[tuple] = None,
             outer: Optional[tuple[float, float, int]] = None) -> dict[str, Any]:
    """Train ``workers`` simulated workers for ``steps`` inner steps (or until the metric reaches ``target``);
    return the curve ``[[step, mean local loss, global loss], ...]`` and the step the target was reached at."""
    from benchmarks.common.gpt import TextBatches, lm_loss, load_text, validation_windows

    train, val = text if text is not None else load_text()
    x_val, y_val = validation_windows(val, eval_windows, 64)
    lr, momentum, warmup = outer if outer is not None else auto_outer(workers, H)
    models = [_model(seed, width) for _ in range(workers)]  # the same initial weights on every worker
    inner = [torch.optim.Adam(m.parameters(), lr=3e-3) for m in models]
    streams = [TextBatches(train, 8, 64, seed, w) for w in range(workers)]

    def outer_sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    plist = [list(m.parameters()) for m in models]
    parts = split_fragments([p.numel() for p in plist[0]], fragments)
    frags = [[Fragment(i, [ps[k] for k in part], outer_sgd) for i, part in enumerate(parts)] for ps in plist]
    offsets = sync_offsets(H, fragments)
    lag = 0 if mode == "none" else tau
    pending: dict[int, tuple[int, torch.Tensor]] = {}  # fragment -> (finish step, average)
    taken = [0] * fragments  # outer steps of each fragment
    last: dict[int, torch.Tensor] = {}  # fragment -> its last average

    def set_lr(p: int) -> None:
        for w in range(workers):
            for group in frags[w][p].outer.param_groups:
                group["lr"] = lr * min(1.0, (taken[p] + 1) / warmup) if warmup else lr

    def finish(p: int) -> None:
        _, avg = pending.pop(p)
        set_lr(p)
        for w in range(workers):
            frags[w][p].delta.copy_(avg)
            frags[w][p].outer_step(alpha if mode == "merge" else 0.0, eager=mode.startswith("eager"))
        taken[p] += 1

    index = {id(p): i for i, p in enumerate(plist[0])}
    probe = _model(seed, width)

    def evaluate() -> tuple[float, float]:
        with torch.no_grad():
            local = statistics.mean(float(lm_loss(m.eval()(x_val), y_val)) for m in models)
            probe_params = list(probe.parameters())
            for frag in frags[0]:  # the global weights, the same on every worker
                for param, view in frag._views(frag.global_):
                    probe_params[index[id(param)]].copy_(view)
            g = float(lm_loss(probe.eval()(x_val), y_val))
        for m in models:
            m.train()
        return local, g

    curve = [[0, *evaluate()]]
    reached = None
    for step in range(1, steps + 1):
        for w in range(workers):
            x, y = streams[w].batch(step - 1)
            inner[w].zero_grad()
            lm_loss(models[w](x), y).backward()
            inner[w].step()
        for p in list(pending):
            if pending[p][0] <= step:
                finish(p)
        for p in due_fragments(step, H, offsets):
            deltas = [frags[w][p].pseudo_gradient().clone() for w in range(workers)]
            if mode.startswith("eager"):
                set_lr(p)
                for w in range(workers):
                    prev = last.get(p)
                    if mode == "eager" or (prev is None and mode != "eager-oracle"):
                        stand_in = deltas[w]
                    elif mode == "eager-paper":
                        stand_in = deltas[w] / workers + prev * ((workers - 1) / workers)
                    elif mode == "eager-prev":
                        stand_in = prev
                    elif mode == "eager-zero":
                        stand_in = torch.zeros_like(prev)
                    elif mode == "eager-oracle":
                        stand_in = sum(deltas[1:], deltas[0]) / workers
                    elif mode == "eager-own":
                        stand_in = deltas[w] / workers
                    frags[w][p].eager_step(stand_in.clone())
            pending[p] = (step + lag, sum(deltas[1:], deltas[0]) / workers)
            last[p] = pending[p][1]
            if lag == 0:
                finish(p)
        if step % eval_every == 0:
            local, g = evaluate()
            curve.append([step, round(local, 4), round(g, 4)])
            if reached is None and local <= target:
                reached = step
                break
    return {"workers": workers, "mode": mode, "outer": [lr, momentum, warmup], "seed": seed, "H": H, "tau": 0 if mode == "none" else tau,
            "fragments": fragments, "steps_to_target": reached, "steps_run": curve[-1][0], "curve": curve}


def steps_to(curve: Sequence[Sequence[float]], target: float, column: int = 1) -> Optional[int]:
    """The first evaluated step whose metric (``column`` 1: the workers' own weights, 2: the global weights) is at
    most ``target``; None if none is.

    Example:
        >>> steps_to([[0, 5.0, 5.0], [20, 2.5, 2.6], [40, 2.3, 2.4]], 2.45)
        40
    """
    return next((int(row[0]) for row in curve if row[column] <= target), None)


def summarize(runs: Sequence[dict], targets: Sequence[float], column: int = 1) -> list[dict[str, Any]]:
    """Per worker count, mode and target: each seed's steps to the target (None: not within the run) and their
    median, over the runs' curves."""
    out = []
    keys = sorted({(r["workers"], r["mode"], r["fragments"], r["tau"]) for r in runs})
    for target in targets:
        for workers, mode, fragments, tau in keys:
            same = sorted((r for r in runs if (r["workers"], r["mode"], r["fragments"], r["tau"]) ==
                           (workers, mode, fragments, tau)), key=lambda r: r["seed"])
            steps = [steps_to(r["curve"], target, column) for r in same]
            done = [s for s in steps if s is not None]
            out.append({"target": target, "workers": workers, "mode": mode, "fragments": fragments, "tau": tau,
                        "seeds": [r["seed"] for r in same], "steps": steps,
                        "median": statistics.median(done) if len(done) == len(steps) else None,
                        "final": [round(r["curve"][-1][column], 4) for r in same]})
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.to_target.eager_overlap", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--overlap-steps", type=int, default=5)
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--steps", type=int, default=400, help="the most inner steps of a run")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--target", type=float, default=2.5, help="validation loss to reach")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--outer", default=None, help="lr,momentum,warmup of the outer SGD (default: DiLoCo's auto)")
    p.add_argument("--json", default=None, help="write every run here")
    p.add_argument("--summarize", nargs="+", default=None, metavar="JSON",
                   help="print steps to each of --targets from these runs' curves instead of running")
    p.add_argument("--targets", type=float, nargs="+", default=[2.6, 2.5])
    args = p.parse_args(argv)
    if args.summarize:
        runs = [r for path in args.summarize for r in json.load(open(path))["runs"]]
        for column, name in ((1, "the workers' own weights"), (2, "the global weights")):
            print(f"steps to the target, {name} (seeds in order; median over seeds)")
            for row in summarize(runs, args.targets, column):
                print(f"  target {row['target']}  M={row['workers']}  {row['mode']:6s} F={row['fragments']} "
                      f"tau={row['tau']}: {row['steps']} median {row['median']}  final {row['final']}")
        return 0
    torch.set_num_threads(1)
    from benchmarks.common.gpt import load_text

    text = load_text()
    runs = []
    for workers in args.workers:
        for seed in args.seeds:
            for mode in args.modes:
                t0 = time.perf_counter()
                run = simulate(workers, mode, seed, args.sync_every, args.overlap_steps, args.fragments, args.steps,
                               args.eval_every, args.target, width=args.width, text=text,
                               outer=None if args.outer is None else (float(args.outer.split(",")[0]),
                                                                       float(args.outer.split(",")[1]),
                                                                       int(args.outer.split(",")[2])))
                runs.append(run)
                print(f"M={workers} seed={seed} {mode:6s} steps to {args.target}: {run['steps_to_target']} "
                      f"(last {run['curve'][-1]}; {time.perf_counter() - t0:.0f} s)", flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"command": " ".join(sys.argv), "args": vars(args), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
