"""Tabulate the unequal-speeds benchmark (:mod:`benchmarks.to_target.unequal`): medians, the ideal, ratios, a plot.

``python -m benchmarks.to_target.unequal_report docs/log/results/unequal-workers.json`` prints the table, writes
``<name>-table.json`` and ``<name>.png`` beside the input (one panel per link: time to target per profile).

- **ideal** of a profile at a link: the equal-speed time of synchronous DiLoCo (today's pick) at that link x 4 / the
  sum of the speeds; for ``dip`` the equal time plus the compute rank 3 loses: ``n x c x (1/0.3 - 1) / 4`` with
  ``c`` = the equal run's time per step and ``n`` = the dip's steps.
- **vs ideal** = time / ideal (1.0 is the cluster's compute used fully); **vs sync** = synchronous DiLoCo's time /
  this time (higher is sooner); **tokens vs equal** = tokens to target / synchronous DiLoCo's equal-speed tokens.

Medians over the seeds that reached the target; ``n/m`` says how many of how many did.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Optional, Sequence

__all__ = ["ideal_time", "summarize", "format_table", "main"]

REFERENCE = "diloco"


def ideal_time(speeds: Sequence[float], equal_time: float, equal_steps: Optional[int] = None,
               dip: Optional[dict] = None) -> float:
    """The time to target if the cluster's compute were used fully.

    Example:
        >>> round(ideal_time([1, 0.8, 0.6, 0.4], 100.0), 1), ideal_time([1, 1, 1, 1], 100.0, 200,
        ...                                                              {"steps": 100, "speed": 0.5})
        (142.9, 112.5)
    """
    if dip:
        per_step = equal_time / equal_steps
        return equal_time + dip["steps"] * per_step * (1 / dip["speed"] - 1) / len(speeds)
    return equal_time * len(speeds) / sum(speeds)


def _median(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (link, profile, system): medians over seeds, the ideal and the ratios."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["link"], r["profile"], r["system"]), []).append(r)
    table = []
    for (link, profile, system), rs in groups.items():
        hit = [r for r in rs if r["status"] == "reached"]
        entry = {"link": link, "profile": profile, "system": system, "speeds": rs[0]["speeds"],
                 "reached": f"{len(hit)}/{len(rs)}", "seeds": sorted(r["seed"] for r in rs),
                 "time_s": _median([r["time_to_target_s"] for r in hit]) if len(hit) * 2 > len(rs) else None,
                 "times_s": sorted(r["time_to_target_s"] for r in hit),
                 "steps": _median([r["steps_to_target"] for r in hit]),
                 "tokens": _median([r["tokens_to_target"] for r in hit]),
                 # per seed, the most steps of one worker whose compute alone exceeded --step-s (load), in %
                 "overrun_pct": [round(100 * max((w.get("overruns") or 0) / max(w.get("steps") or 1, 1)
                                                 for w in r["workers"]) if r.get("workers") else 0)
                                 for r in sorted(rs, key=lambda r: r["seed"])]}
        if hit:
            mid = sorted(hit, key=lambda r: r["time_to_target_s"])[len(hit) // 2]
            entry["worker_steps"] = mid["worker_steps_to_target"]
            entry["workers"] = [{k: w.get(k) for k in ("speed", "steps", "compute_s", "pad_s", "step_tail_s")}
                                for w in mid["workers"]]
            for i, w in enumerate(entry["workers"]):  # the system's own report, when it keeps one
                rounds = mid.get("rounds") or []
                if rounds:
                    w.update(rounds=len(rounds), steps_per_round=sum(r[1][i] for r in rounds) / len(rounds),
                             wait_s=sum(r[2][i] for r in rounds), exchange_s=sum(r[3][i] for r in rounds))
        table.append(entry)
    by = {(e["link"], e["profile"], e["system"]): e for e in table}
    for e in table:
        eq = by.get((e["link"], "equal", REFERENCE))
        sync = by.get((e["link"], e["profile"], REFERENCE))
        e["ideal_s"] = e["vs_ideal"] = e["vs_sync"] = e["tokens_vs_equal"] = None
        if eq and eq["time_s"]:
            dip = next((r.get("dip") for r in rows if r["profile"] == e["profile"] and r.get("dip")), None)
            e["ideal_s"] = ideal_time(e["speeds"], eq["time_s"], eq["steps"], dip)
            e["vs_ideal"] = e["time_s"] / e["ideal_s"] if e["time_s"] else None
            e["tokens_vs_equal"] = e["tokens"] / eq["tokens"] if e["tokens"] and eq["tokens"] else None
        if sync and sync["time_s"] and e["time_s"]:
            e["vs_sync"] = sync["time_s"] / e["time_s"]
    order = {"equal": 0, "half": 1, "graded": 2, "dip": 3}
    return sorted(table, key=lambda e: (e["link"], order.get(e["profile"], 9), e["system"]))


def format_table(table: list[dict]) -> str:
    """A markdown table of :func:`summarize`'s entries."""
    fmt = (lambda v, spec: "-" if v is None else format(v, spec))
    lines = ["| link | profile | system | reached | time to target s (median [seeds]) | ideal s | vs ideal | "
             "vs sync DiLoCo | steps (rank 0) | tokens vs equal | worker steps at target | overrun % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in table:
        times = ", ".join(f"{t:.0f}" for t in e["times_s"])
        lines.append(f"| {e['link']} | {e['profile']} ({','.join(f'{s:g}' for s in e['speeds'])}) | {e['system']} | "
                     f"{e['reached']} | {fmt(e['time_s'], '.1f')} [{times}] | {fmt(e['ideal_s'], '.1f')} | "
                     f"{fmt(e['vs_ideal'], '.2f')}x | {fmt(e['vs_sync'], '.2f')}x | {fmt(e['steps'], '.0f')} | "
                     f"{fmt(e['tokens_vs_equal'], '.2f')}x | {e.get('worker_steps', '-')} | "
                     f"{', '.join(str(p) for p in e.get('overrun_pct', []))} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the table; write the table JSON and the plot beside the results."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.to_target.unequal_report")
    p.add_argument("results", help="the JSON written by benchmarks.to_target.unequal")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    with open(args.results) as f:
        data = json.load(f)
    table = summarize(data["rows"])
    print(format_table(table))
    stem = os.path.splitext(args.results)[0]
    with open(f"{stem}-table.json", "w") as f:
        json.dump(table, f, indent=1)
    if not args.no_plot:
        from benchmarks.common.plots import plot_unequal

        plot_unequal(table, f"{stem}.png", caption="4 emulated hosts, GPT (see the log page); medians over seeds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
