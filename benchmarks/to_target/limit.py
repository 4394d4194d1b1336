"""The free-exchange limit beside a time to target: ``python -m benchmarks.to_target.limit FILE.json ...``.

A system's *limit* is its time to the target if its exchange cost nothing: its steps to the target x its
compute-only step (``compute_s``: the median step of an unwrapped replica, same data and optimizer, no
communication, timed on every rank right after the timed steps; :mod:`benchmarks.common.workload`). Per seed
``steps x compute``, then the median over the seeds, as the time to target's own median. Against DDP, at each link:

    limit vs DDP = DDP's median time to target there / the system's limit
    efficiency   = (measured vs DDP) / (limit vs DDP) = the limit / the measured time

``compute`` is the median of the system's own ``compute_s`` over its ``step_time`` rows in the file (one block of
step times); a system with none (async, trained for real at each link) takes DDP's, and its steps are those of its
unshaped run. The files are merged ``benchmarks.common.report`` results with a ``time_to_target`` table.

Example:
    >>> limit_row([200, 280, 240], 1.5, 18_783.0, 34.7)["limit_vs_ddp"]  # 4 hosts, 10 Mbit/s, 2026-11-28
    52.175
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Optional, Sequence

__all__ = ["limit_row", "limits", "format_markdown", "main"]


def limit_row(steps: Sequence[Optional[int]], compute_s: float, ddp_time_s: float,
              vs_ddp: Optional[float]) -> dict:
    """The limit of one system at one link: ``steps`` per seed (``None``: missed), its compute step, DDP's median
    time to target at that link and the measured ratio against it (``None`` when not timed)."""
    reached = [s for s in steps if s is not None]
    if not reached or len(reached) < len(steps) / 2:
        return {"limit_s": None, "limit_vs_ddp": None, "efficiency": None}
    per_seed = [float("inf") if s is None else s * compute_s for s in steps]
    limit_s = statistics.median(per_seed)
    limit_vs_ddp = round(ddp_time_s / limit_s, 3)
    efficiency = None if vs_ddp is None else round(vs_ddp / (ddp_time_s / limit_s), 3)
    return {"limit_s": limit_s, "limit_vs_ddp": limit_vs_ddp, "efficiency": efficiency}


def _compute_by_system(results: list[dict]) -> dict[tuple[int, str], float]:
    values: dict[tuple[int, str], list[float]] = {}
    for r in results:
        if r.get("phase") == "step_time" and r.get("compute_s"):
            values.setdefault((r["hosts"], r["system"]), []).append(r["compute_s"])
    return {k: statistics.median(v) for k, v in values.items()}


def limits(data: dict) -> list[dict]:
    """Every (hosts, system, link) of a merged result's ``time_to_target`` table with its limit and efficiency."""
    table = data["time_to_target"]["table"]
    compute = _compute_by_system(data["results"])
    ddp_time = {(t["hosts"], t["bandwidth"]): t["time_spread"]["median"] for t in table if t["system"] == "ddp"}
    unshaped_steps = {(t["hosts"], t["system"]): t["steps"] for t in table if t["bandwidth"] == "unshaped"}
    out = []
    for t in table:
        key = (t["hosts"], t["system"])
        c, source = compute.get(key), "own"
        if c is None:
            c, source = compute.get((t["hosts"], "ddp")), "ddp"
        ddp = ddp_time.get((t["hosts"], t["bandwidth"]))
        if c is None or ddp is None:
            continue
        steps = t["steps"] if t.get("method") != "real run" else unshaped_steps.get(key, t["steps"])
        row = {"hosts": t["hosts"], "system": t["system"], "bandwidth": t["bandwidth"], "steps": steps,
               "compute_s": c, "compute_from": source, "vs_ddp": t.get("vs_ddp")}
        row.update(limit_row(steps, c, ddp, t.get("vs_ddp")))
        out.append(row)
    return out


def format_markdown(rows: list[dict]) -> str:
    """One line per (hosts, system): measured / limit (efficiency) at each link, in the table's link order."""
    links = list(dict.fromkeys(r["bandwidth"] for r in rows))
    lines = ["| hosts | system | compute step | " + " | ".join(links) + " |", "|---|---|---|" + "---|" * len(links)]
    for hosts, system in dict.fromkeys((r["hosts"], r["system"]) for r in rows):
        cells = []
        for link in links:
            r = next((x for x in rows if (x["hosts"], x["system"], x["bandwidth"]) == (hosts, system, link)), None)
            if r is None or r["limit_vs_ddp"] is None:
                cells.append("")
                continue
            measured = "-" if r["vs_ddp"] is None else f"{r['vs_ddp']:.2f}x"
            eff = "" if r["efficiency"] is None else f" ({r['efficiency']:.2f})"
            cells.append(f"{measured} / {r['limit_vs_ddp']:.3g}x{eff}")
        c = next(x for x in rows if (x["hosts"], x["system"]) == (hosts, system))
        lines.append(f"| {hosts} | {system} | {c['compute_s']:.3f} s ({c['compute_from']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    """Print the limit table of every file; with ``--json``, write the rows too."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.to_target.limit", description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="merged results with a time_to_target table")
    p.add_argument("--json", default=None, help="write every row, with its file, here")
    args = p.parse_args(argv)
    rows = []
    for path in args.files:
        with open(path) as f:
            found = limits(json.load(f))
        for r in found:
            r["file"] = path
        rows += found
        print(f"\n{path}\n{format_markdown(found)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
