"""DiLoCo's outer optimizer swept against DDP on the GPT: ``python -m benchmarks.to_target.diloco_sweep``.

Every point of the grid (outer learning rate x Nesterov momentum x ``sync_every`` x pseudo-gradient compression x
outer-lr warm-up) is one convergence run of the time-to-accuracy benchmark (``benchmarks.network --to-target
--loopback``: the GPT, one rank per host, Adam inner steps, the per-host batch of 8 x 128 bytes), stopped at
``--steps`` (the pruning step) unless it reaches the target first. Steps do not depend on the link or the load, so
the points run on loopback, one after another, and points already in ``--out-dir`` are skipped (a sweep resumes).

``--summarize`` reads every run in the given directories and compares each with DDP's validation curve of the same
host count and seed, taken from a reference result file (``--reference``, the benchmark's own DDP runs). The measure
is **progress per step against DDP**: the step at which DDP's curve reaches the point's loss at step ``P``, divided
by ``P`` (1.0: as fast as DDP per step; 0.8: DDP needs 80 % of the steps for the same loss). Runs:

    python -m benchmarks.to_target.diloco_sweep --hosts 4 --seeds 0 --outer-lr 1.0,1.5,2.0 --momentum 0,0.5 \\
        --sync-every 10 --compression uint4 --steps 200 --out-dir /tmp/sweep
    python -m benchmarks.to_target.diloco_sweep --summarize /tmp/sweep \\
        --reference docs/log/results/to-target-gpt-4hosts.json --at 100,200 --json /tmp/sweep.json
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["point_system", "point_name", "grid", "ddp_step_for", "summarize_rows", "main"]


def point_system(sync_every: int, outer_lr: float, momentum: float, compression: str,
                 outer_lr_warmup: int = 0) -> str:
    """The benchmark's system spec of one point (flat exchange, one rank per host, as the 2- and 4-host tables)."""
    spec = (f"diloco:sync_every={sync_every}:hierarchical=False:compression={compression}:outer_lr={outer_lr}"
            f":outer_momentum={momentum}")
    return spec + (f":outer_lr_warmup={outer_lr_warmup}" if outer_lr_warmup else "")


def point_name(hosts: int, seed: int, sync_every: int, outer_lr: float, momentum: float, compression: str,
               outer_lr_warmup: int = 0) -> str:
    """A file-name-safe name of one point, e.g. ``m4-h10-lr1.5-m0.0-uint4-s0``."""
    name = f"m{hosts}-h{sync_every}-lr{outer_lr}-m{momentum}-{compression}"
    return name + (f"-w{outer_lr_warmup}" if outer_lr_warmup else "") + f"-s{seed}"


def grid(args: argparse.Namespace) -> list[tuple[str, int, int, str]]:
    """(name, hosts, seed, system) of every point, in the order they run (seed outermost)."""
    points = []
    for seed, hosts, h, lr, m, comp, w in itertools.product(args.seeds, args.hosts, args.sync_every, args.outer_lr,
                                                           args.momentum, args.compression, args.outer_lr_warmup):
        points.append((point_name(hosts, seed, h, lr, m, comp, w), hosts, seed, point_system(h, lr, m, comp, w)))
    return points


def _convergence_rows(paths: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        results = data.get("results", []) if isinstance(data, dict) else []
        for row in results if isinstance(results, list) else []:
            if isinstance(row, dict) and row.get("phase") in ("convergence", "real") and row.get("curve") and row.get("model") == "gpt":
                rows.append({**row, "file": os.path.basename(path)})
    return rows


def ddp_step_for(curve: Sequence[Sequence[float]], loss: float) -> Optional[float]:
    """The (linearly interpolated) step at which a validation curve ``[[step, ..., loss], ...]`` first reaches
    ``loss``; None if it never does.

    Example:
        >>> ddp_step_for([[0, 0, 0, 5.0], [20, 0, 0, 3.0], [40, 0, 0, 2.0]], 2.5)
        30.0
    """
    for (s0, *_, l0), (s1, *_, l1) in zip(curve, curve[1:]):
        if l1 <= loss:
            if l0 <= loss:
                return float(s0)
            return s0 + (s1 - s0) * (l0 - loss) / (l0 - l1)
    return None


def _loss_at(curve: Sequence[Sequence[float]], step: int) -> Optional[float]:
    for s, *_, loss in curve:
        if s == step:
            return float(loss)
    return None


def summarize_rows(rows: Sequence[dict], reference: Sequence[dict], at: Sequence[int]) -> list[dict[str, Any]]:
    """One summary per DiLoCo run: its loss at each step of ``at``, DDP's loss there (same hosts and seed), the
    progress per step against DDP at that step, and the steps to the target if reached."""
    ddp = {(r["hosts"], r["seed"]): r for r in reference if r["system"] == "ddp"}
    out = []
    for r in rows:
        if not r["system"].startswith("diloco"):
            continue
        ref = ddp.get((r["hosts"], r["seed"]))
        entry: dict[str, Any] = {"system": r["system"], "hosts": r["hosts"], "seed": r["seed"],
                                 "steps_to_target": r.get("steps_to_target"), "steps_run": r.get("steps_run"),
                                 "ddp_steps_to_target": ref.get("steps_to_target") if ref else None}
        for step in at:
            loss = _loss_at(r["curve"], step)
            entry[f"loss@{step}"] = loss
            if ref is None or loss is None:
                continue
            entry[f"ddp_loss@{step}"] = _loss_at(ref["curve"], step)
            equivalent = ddp_step_for(ref["curve"], loss)
            entry[f"progress@{step}"] = None if equivalent is None else round(equivalent / step, 3)
        out.append(entry)
    last = f"progress@{max(at)}"
    return sorted(out, key=lambda e: (e["hosts"], -(e.get(last) or 0.0)))


def _print_table(summary: Sequence[dict], at: Sequence[int]) -> None:
    cols = [f"loss@{s}" for s in at] + [f"progress@{s}" for s in at]
    print("| hosts | seed | system | " + " | ".join(cols) + " | steps to target (DDP) |")
    print("|" + "---|" * (4 + len(cols)))
    for e in summary:
        cells = ["-" if e.get(c) is None else f"{e[c]:.3f}" for c in cols]
        reached = e["steps_to_target"] if e["steps_to_target"] is not None else f"> {e['steps_run']}"
        short = e["system"].replace("diloco:", "").replace("hierarchical=False:", "")
        print(f"| {e['hosts']} | {e['seed']} | {short} | " + " | ".join(cells)
              + f" | {reached} ({e['ddp_steps_to_target']}) |")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.to_target.diloco_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=_ints, default=[4], help="comma list of host counts (workers M)")
    p.add_argument("--seeds", type=_ints, default=[0])
    p.add_argument("--outer-lr", type=_floats, default=[1.0])
    p.add_argument("--momentum", type=_floats, default=[0.0], help="Nesterov momentum of the outer SGD")
    p.add_argument("--sync-every", type=_ints, default=[10], help="H, inner steps between synchronizations")
    p.add_argument("--compression", type=lambda s: s.split(","), default=["uint4"])
    p.add_argument("--outer-lr-warmup", type=_ints, default=[0], help="outer steps of linear outer-lr warm-up")
    p.add_argument("--steps", type=int, default=200, help="the pruning step: a point stops here")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--out-dir", default="/tmp/diloco-sweep")
    p.add_argument("--dry-run", action="store_true", help="print the points and their commands only")
    p.add_argument("--summarize", nargs="*", default=None, metavar="DIR",
                   help="summarize the runs in these directories instead of running")
    p.add_argument("--reference", action="append", default=[],
                   help="result file with DDP's convergence runs (repeatable)")
    p.add_argument("--at", type=_ints, default=[100, 200], help="steps at which to compare with DDP")
    p.add_argument("--json", default=None, help="with --summarize: also write the summary here")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.summarize is not None:
        paths = [p for d in args.summarize for p in sorted(glob.glob(os.path.join(d, "*.json")))]
        if not args.reference:
            raise SystemExit("--summarize needs --reference FILE with DDP's runs (e.g. "
                             "docs/log/results/to-target-gpt-4hosts.json)")
        summary = summarize_rows(_convergence_rows(paths), _convergence_rows(args.reference), args.at)
        _print_table(summary, args.at)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": " ".join(sys.argv), "summary": summary}, f, indent=1)
        return 0
    os.makedirs(args.out_dir, exist_ok=True)
    points = grid(args)
    for i, (name, hosts, seed, system) in enumerate(points, 1):
        if os.path.exists(os.path.join(args.out_dir, f"{name}.json")):
            print(f"[{i}/{len(points)}] {name}: done, skipped", flush=True)
            continue
        cmd = [sys.executable, "-m", "benchmarks.network", "--to-target", "--loopback", "--hosts", str(hosts),
               "--models", "gpt", "--seeds", "1", "--first-seed", str(seed), "--systems", system,
               "--target", "gpt=2.40", "--max-steps", str(args.steps), "--eval-every", str(args.eval_every),
               "--eval-samples", "64", "--warmup", "1", "--steps", "1", "--out-dir", args.out_dir, "--name", name]
        print(f"[{i}/{len(points)}] {name}: {' '.join(cmd[1:])}", flush=True)
        if not args.dry_run:
            subprocess.run(cmd, cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
