"""Fragments with one step of overlap against today's picks: ``python -m benchmarks.to_target.overlap_remedy``.

Issue 65, item 1: an overlapped outer step that does not cost steps at 4 and 8 hosts. A one-process simulation
(:mod:`benchmarks.to_target.eager_overlap`) found ``fragments=5, overlap_steps=1`` at (nearly) no overlap's steps.
This module combines the benchmark GPT's steps to val loss 2.40 (:data:`STEPS`, measured on unshaped links by
``python -m benchmarks.network --to-target --loopback``) with step times taken in one block per link by
:mod:`benchmarks.to_target.one_megabit` (``--rate 10mbit`` or ``1mbit``: unshaped start-up, shaped timed steps),
and writes per (hosts, link, system):

- time to target = the median over the seeds of steps x mean step (the exchange included);
- the limit = steps x ``compute_s`` (the same system's compute-only step of the same run), efficiency = limit /
  time, as :mod:`benchmarks.to_target.limit`;
- against DDP of the same block (when it was timed there) and against the *reference* (today's pick of that host
  count and link, timed in the same block): ``vs_pick`` = the pick's time / this one's, ``vs_pick_limit`` = the
  pick's own limit / this one's time (at least 0.9 is the issue's goal read against the pick's free exchange).

Example::

    python -m benchmarks.to_target.overlap_remedy --report t4.json t8.json --out docs/log/results/overlap-remedy.json

Example:
    >>> rows = [{"system": "ddp", "hosts": 4, "bandwidth": "10mbit", "status": "ok", "mean_step_s": 60.0,
    ...          "compute_s": 1.5, "step_times_s": [60.0]},
    ...         {"system": "x", "hosts": 4, "bandwidth": "10mbit", "status": "ok", "mean_step_s": 2.0,
    ...          "compute_s": 1.5, "step_times_s": [1.5] * 9 + [6.5]}]
    >>> t = report(rows, {(4, "ddp"): ([300], "f"), (4, "x"): ([200], "f")}, {4: "x"})
    >>> [(r["system"], r["vs_ddp"], r["efficiency"]) for r in t]
    [('ddp', 1.0, 0.025), ('x', 45.0, 0.75)]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Optional, Sequence

__all__ = ["W", "W_NF2", "REMEDY", "REMEDY_WHOLE", "STEPS", "PICKS", "report", "main"]

#: today's 8-host pick (and the 4-host uint4 pick of 2026-11-28): the warmed-up Nesterov outer step, uint4
W = "diloco:sync_every=10:hierarchical=False:compression=uint4:outer_lr=1.0:outer_momentum=0.5:outer_lr_warmup=10"
#: today's 4-host pick at 10 Mbit/s: the same with 2-bit nf2 codes
W_NF2 = W.replace("compression=uint4", "compression=nf2:block_size=256")
#: the candidate: five fragments, each exchanged behind one inner step
REMEDY = W + ":fragments=5:overlap_steps=1"
#: the same taking the outer step whole at the merge (the inner step made meanwhile is dropped)
REMEDY_WHOLE = REMEDY + ":overlap_alpha=0.0"

#: (hosts, system) -> (steps to val loss 2.40 per seed, where they were measured); seeds 0, 1, 2 in order
STEPS: dict[tuple[int, str], tuple[list[int], str]] = {
    (4, "ddp"): ([320, 320, 380], "to-target-gpt-4hosts-outer.json"),
    (4, W): ([200, 280, 240], "to-target-gpt-4hosts-outer.json"),
    (4, W_NF2): ([220, 300, 240], "to-target-gpt-4hosts-nf2.json"),
    (4, REMEDY): ([400], "overlap-remedy-4hosts-f5t1-s0.json (seed 0)"),
    (4, REMEDY_WHOLE): ([240, 280], "overlap-remedy-4hosts-f5t1-alpha0-s{0,1}.json (seeds 0-1)"),
    (8, "ddp"): ([320, 300, 300], "to-target-gpt-8hosts.json"),
    (8, W): ([200, 180, 200], "to-target-gpt-8hosts.json"),
    (8, W_NF2): ([220, 180, 220], "nf2-8hosts-s{0,1,2}.json"),
}
#: the reference of each host count: today's pick at 10 Mbit/s (picks.json)
PICKS = {4: W_NF2, 8: W}


def _time(steps: Sequence[int], step_s: float) -> float:
    return statistics.median(s * step_s for s in steps)


def report(rows: list[dict], steps: Optional[dict] = None, picks: Optional[dict] = None) -> list[dict]:
    """One entry per timed (hosts, link, system) with steps in ``steps`` (default :data:`STEPS`), against the
    block's DDP and its pick (default :data:`PICKS`); rows are ``one_megabit`` rows (``phase="step_time"``)."""
    steps = STEPS if steps is None else steps
    picks = PICKS if picks is None else picks
    out = []
    for hosts, link in sorted({(r["hosts"], r["bandwidth"]) for r in rows}):
        mine = {r["system"]: r for r in rows if (r["hosts"], r["bandwidth"]) == (hosts, link) and
                r.get("status") == "ok"}
        ddp = mine.get("ddp")
        ddp_time = _time(steps[(hosts, "ddp")][0], ddp["mean_step_s"]) if ddp else None
        pick = mine.get(picks.get(hosts))
        pick_steps = steps[(hosts, pick["system"])][0] if pick else None
        for system, row in mine.items():
            if (hosts, system) not in steps:
                continue
            s, source = steps[(hosts, system)]
            inner = row["compute_s"] if system == "ddp" else statistics.median(row["step_times_s"])
            time_s, limit_s = _time(s, row["mean_step_s"]), _time(s, row["compute_s"])
            entry = {"hosts": hosts, "bandwidth": link, "system": system, "steps": s, "steps_from": source,
                     "mean_step_s": row["mean_step_s"], "inner_step_s": inner, "compute_s": row["compute_s"],
                     "exposed_s": max(row["mean_step_s"] - inner, 0.0), "time_s": time_s,
                     "vs_ddp": round(ddp_time / time_s, 3) if ddp_time else None,
                     "limit_vs_ddp": round(ddp_time / limit_s, 3) if ddp_time else None,
                     "efficiency": round(limit_s / time_s, 3),
                     "load": [row.get("load_start"), row.get("load_end")]}
            if pick is not None:
                entry["vs_pick"] = round(_time(pick_steps, pick["mean_step_s"]) / time_s, 3)
                entry["vs_pick_limit"] = round(_time(pick_steps, pick["compute_s"]) / time_s, 3)
            out.append(entry)
    return out


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    """Combine ``--report`` files' timed rows with :data:`STEPS`; print the table and write it to ``--out``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.to_target.overlap_remedy",
                                description=__doc__.splitlines()[0])
    p.add_argument("--report", nargs="+", required=True, metavar="TIMES.json", help="one_megabit.py outputs")
    p.add_argument("--out", required=True, help="JSON file: the table and every timed row")
    args = p.parse_args(argv)
    rows = [r for path in args.report for r in json.load(open(path))["results"]]
    table = report(rows)
    with open(args.out, "w") as f:
        json.dump({"table": table, "results": rows}, f, indent=1)
    for t in table:
        vs = "" if t["vs_ddp"] is None else f"{t['vs_ddp']:6.1f}x / {t['limit_vs_ddp']:6.1f}x "
        print(f"{t['hosts']} {t['bandwidth']:7s} {t['system'][-50:]:50s} step {t['mean_step_s']:7.2f} inner "
              f"{t['inner_step_s']:5.2f} compute {t['compute_s']:5.2f} | {vs}({t['efficiency']:.2f}) | "
              f"pick {t.get('vs_pick', float('nan')):.2f} pick-limit {t.get('vs_pick_limit', float('nan')):.2f}")
    return table


if __name__ == "__main__":
    main()
