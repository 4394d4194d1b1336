"""DiLoCo with sparse ``topk`` pseudo-gradients beside today's picks: ``python -m benchmarks.to_target.sparse_diloco``.

Issue 65, item 2 on the benchmark GPT: fewer bytes where bits alone no longer help. The warmed-up pick's settings
with ``compression=topk:block_size=256`` (each block's 8 largest of 256 values, 4-bit codes, one-byte positions:
0.5 bits per value, exchanged by all-gather with error feedback) against the 4-host pick (``nf2``) and the
``uint4`` pick. Steps to val loss 2.40 come from ``python -m benchmarks.network --to-target --loopback`` runs
(:data:`STEPS`, or ``--steps`` files, whose ``steps_to_target`` rows are read); step times from one block of
:mod:`benchmarks.to_target.one_megabit` (unshaped start-up, timed steps at ``--rate``). The table is
:func:`benchmarks.to_target.overlap_remedy.report`'s: time to target = median over the seeds of steps x mean
step, the limit = steps x ``compute_s``, efficiency = limit / time, ``vs_pick`` against the 4-host pick of the same
block (one block per ``--report`` file); ``inner_efficiency`` = median step / mean step, the efficiency with the
median (inner) step for the compute step, which a loaded machine measures more steadily than ``compute_s``.

Example::

    python -m benchmarks.to_target.sparse_diloco --report t4-10mbit.json \\
        --steps sparse-4hosts-topk-s0.json sparse-4hosts-topk-s1.json --out docs/log/results/sparse-diloco.json

Example:
    >>> steps_from([{"system": "x", "hosts": 4, "phase": "convergence", "seed": 1, "steps_to_target": 240},
    ...             {"system": "x", "hosts": 4, "phase": "convergence", "seed": 0, "steps_to_target": 200}])
    {(4, 'x'): ([200, 240], 'seeds 0, 1')}
    >>> steps_from([{"system": "x", "hosts": 4, "phase": "convergence", "seed": 0, "steps_to_target": None,
    ...              "steps_run": 400}])
    {(4, 'x'): ([400], 'seeds 0; seed 0 missed at 400, counted as 400')}
"""

from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

from benchmarks.to_target import overlap_remedy

__all__ = ["W_TOPK", "STEPS", "steps_from", "main"]

#: the candidate: the warmed-up pick's outer step with sparse topk pseudo-gradients
W_TOPK = overlap_remedy.W.replace("compression=uint4", "compression=topk:block_size=256")

#: (hosts, system) -> (steps to val loss 2.40 per seed, where they were measured): the picks' stored runs
STEPS: dict[tuple[int, str], tuple[list[int], str]] = {
    k: v for k, v in overlap_remedy.STEPS.items() if k[1] in ("ddp", overlap_remedy.W, overlap_remedy.W_NF2)}


def steps_from(rows: list[dict]) -> dict[tuple[int, str], tuple[list[int], str]]:
    """Steps to the target per (hosts, system) from ``benchmarks.network`` convergence rows, in seed order; a
    missed target counts as the steps run (a lower bound, said in the source)."""
    found: dict[tuple[int, str], dict[int, tuple[int, bool]]] = {}
    for r in rows:
        if r.get("phase") == "convergence":
            reached = r.get("steps_to_target") is not None
            steps = r["steps_to_target"] if reached else r["steps_run"]
            found.setdefault((r["hosts"], r["system"]), {})[r["seed"]] = (steps, reached)
    out = {}
    for key, by_seed in found.items():
        seeds = sorted(by_seed)
        missed = [f"seed {s} missed at {by_seed[s][0]}, counted as {by_seed[s][0]}" for s in seeds
                  if not by_seed[s][1]]
        out[key] = ([by_seed[s][0] for s in seeds], "; ".join(["seeds " + ", ".join(map(str, seeds)), *missed]))
    return out


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    """Combine ``--report`` timed rows with :data:`STEPS` and the ``--steps`` runs; print and write the table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.to_target.sparse_diloco",
                                description=__doc__.splitlines()[0])
    p.add_argument("--report", nargs="+", required=True, metavar="TIMES.json", help="one_megabit.py outputs")
    p.add_argument("--steps", nargs="*", default=[], metavar="RUN.json", help="benchmarks.network --to-target runs")
    p.add_argument("--out", required=True, help="JSON file: the table, the steps and every timed row")
    args = p.parse_args(argv)
    runs = [r for path in args.steps for r in json.load(open(path))["results"]]
    steps = dict(STEPS)
    steps.update(steps_from(runs))
    table, rows = [], []
    for path in args.report:  # one block of step times per file: each against its own block's pick
        block = json.load(open(path))["results"]
        rows += block
        for t in overlap_remedy.report(block, steps, {4: overlap_remedy.W_NF2, 8: overlap_remedy.W}):
            r = next(r for r in block if (r["hosts"], r["system"], r.get("status")) == (t["hosts"], t["system"], "ok"))
            t.update(block=path, bytes_per_step=r.get("bytes_per_step"),
                     inner_efficiency=round(t["inner_step_s"] / t["mean_step_s"], 3))
            table.append(t)
    with open(args.out, "w") as f:
        json.dump({"table": table, "steps": {f"{h} {s}": v for (h, s), v in steps.items()}, "results": rows}, f,
                  indent=1)
    for t in table:
        print(f"{t['hosts']} {t['bandwidth']:7s} {t['system'][-50:]:50s} steps {t['steps']} step {t['mean_step_s']:6.2f} "
              f"inner {t['inner_step_s']:5.2f} compute {t['compute_s']:5.2f} exposed {t['exposed_s']:5.2f} "
              f"time {t['time_s']:7.0f} s eff {t['efficiency']:.2f} / {t['inner_efficiency']:.2f} vs pick {t.get('vs_pick', float('nan')):.2f} "
              f"pick-limit {t.get('vs_pick_limit', float('nan')):.2f} load {t['load']}")
    return table


if __name__ == "__main__":
    main()
