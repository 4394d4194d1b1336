"""Results of the network suite: per-run summary, speedups, goals, terminal table, JSON, CSV and a PNG plot.

Words used in every output:

- *step*: the median wall time of one training step (zero_grad, forward, backward, communication, optimizer
  step) over the timed steps, taken on each host; the slowest host's median is reported.
- *speedup*: DDP's step divided by the system's step, same model, hosts and bandwidth, same suite run.
- *bytes/step*: bytes a host's interface transmitted per timed step (``/proc/net/dev``), averaged over hosts.
  On the loopback fallback every process shares ``lo``, so it is the loopback total divided by the host count
  and includes any other traffic on the machine (marked approximate).
- *line rate*: bytes sent during the timed steps / (their total duration x link rate): how much of its link
  a host kept busy.
- Phases, per step: *compute* = median step of an unwrapped replica with no communication; *compress* =
  estimated codec time (encode/decode passes of the algorithm, timed in-process); *communicate* = time
  communication operations were running (union of Bagua bucket executions or DDP comm-hook futures) minus
  compress; *wait* = step - compute, the time a step spends beyond its computation (communication not hidden
  behind backward, and engine overhead).

Example:
    >>> rows = add_speedups([{"model": "mlp", "hosts": 2, "bandwidth": "1gbit", "system": "ddp", "status": "ok",
    ...                       "step_s": 1.0}, {"model": "mlp", "hosts": 2, "bandwidth": "1gbit",
    ...                       "system": "bytegrad", "status": "ok", "step_s": 0.25}])
    >>> rows[1]["speedup"]
    4.0
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import platform
import statistics
import sys
from typing import Optional, Sequence
from benchmarks.to_target import to_target, to_target_table
from benchmarks.common.plots import caption_for, plot, plot_time_vs_bandwidth, plot_to_target, runs_of

__all__ = [
    "summarize_ranks",
    "combine_repeats",
    "add_speedups",
    "check_goals",
    "format_table",
    "format_markdown",
    "format_goals",
    "write_results",
    "plot",
    "machine_info",
    "merge",
    "time_to_target_results",
    "speed_rows",
    "format_time_to_target",
    "main",
    "GOALS",
]

#: (description, model, hosts, bandwidth, system, kind, target): kind "speedup_min" needs speedup >= target,
#: "step_ratio_max" needs step / DDP step <= target.
GOALS = [
    ("ByteGrad >= 3x DDP at 1 Gbit/s (2 hosts)", "mlp", 2, "1gbit", "bytegrad", "speedup_min", 3.0),
    ("ByteGrad >= 3.5x DDP at 100 Mbit/s (2 hosts)", "mlp", 2, "100mbit", "bytegrad", "speedup_min", 3.5),
    ("gradient allreduce <= 1.05x DDP step, unshaped (2 hosts)", "mlp", 2, "unshaped", "gradient_allreduce",
     "step_ratio_max", 1.05),
    ("decentralized faster than DDP at 1 Gbit/s (4 hosts)", "mlp", 4, "1gbit", "decentralized", "speedup_min", 1.0),
    ("low-precision decentralized faster than DDP at 1 Gbit/s (4 hosts)", "mlp", 4, "1gbit",
     "low_precision_decentralized", "speedup_min", 1.0),
]



def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize_ranks(ranks: list[dict], rate_bps: Optional[int], emulated: bool) -> dict:
    """Combine the per-rank results of one run into the reported numbers (see the module docstring)."""
    world = len(ranks)
    step = max(r["median_step_s"] for r in ranks)
    if emulated:
        per_step = statistics.mean(r["tx_bytes"] / r["timed_steps"] for r in ranks)
        # bytes over the whole timed window / its duration (a median step would not match a mean of bytes)
        bits_per_s = statistics.mean(8 * r["tx_bytes"] / sum(r["step_times_s"]) for r in ranks)
    else:
        per_step = ranks[0]["tx_bytes"] / ranks[0]["timed_steps"] / world
        bits_per_s = 8 * per_step * ranks[0]["timed_steps"] / sum(ranks[0]["step_times_s"])
    compute = _median([r.get("compute_step_s") for r in ranks])
    busy = _median([r.get("comm_busy_s") for r in ranks])
    codec = _median([r.get("codec_s") for r in ranks])
    accuracies = [r["accuracy"] for r in ranks if r.get("accuracy") is not None]
    return {
        "step_s": step,
        "mean_step_s": max(statistics.mean(r["step_times_s"]) for r in ranks),
        "step_times_s": ranks[0]["step_times_s"],
        "timed_steps": ranks[0]["timed_steps"],
        "samples_per_s": world * ranks[0]["batch_size"] / step,
        "bytes_per_step": per_step,
        "bytes_approximate": not emulated,
        "line_rate": bits_per_s / rate_bps if rate_bps else None,
        "warmup": ranks[0]["warmup"],
        "compute_s": compute,
        "compress_s": codec,
        "communicate_s": max(busy - (codec or 0.0), 0.0) if busy is not None else None,
        "wait_s": max(step - compute, 0.0) if compute is not None else None,
        "accuracy": statistics.mean(accuracies) if accuracies else None,
        "accuracy_min": min(accuracies) if accuracies else None,
        "final_loss": statistics.mean(r["final_loss"] for r in ranks),
        "params": ranks[0]["params"],
        "notes": ranks[0].get("notes", []),
    }


_MEDIAN_FIELDS = ("step_s", "mean_step_s", "samples_per_s", "bytes_per_step", "line_rate", "compute_s", "compress_s",
                  "communicate_s", "wait_s", "accuracy", "accuracy_min", "final_loss",
                  "time_to_target_s", "wall_to_target_s", "steps_to_target", "final_metric")


def combine_repeats(rows: list[dict]) -> list[dict]:
    """Merge the repeats of each configuration (same run, model, hosts, bandwidth, system) into one row whose
    numbers are the medians over the successful repeats; ``step_s_repeats`` keeps each repeat's step."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r.get("run"), r.get("phase"), r.get("seed"), r["model"], r["hosts"], r["bandwidth"], r["system"])
        groups.setdefault(key, []).append(r)
    out = []
    for group in groups.values():
        ok = [r for r in group if r.get("status") == "ok"]
        if len(group) == 1 or not ok:
            out.append(group[-1])
            continue
        row = dict(ok[0])
        for name in _MEDIAN_FIELDS:
            row[name] = _median([r.get(name) for r in ok])
        row["step_s_repeats"] = [r["step_s"] for r in ok]
        row["repeats"] = len(ok)
        row["failed_repeats"] = len(group) - len(ok)
        out.append(row)
    return out


def add_speedups(rows: list[dict]) -> list[dict]:
    """Add ``speedup`` (DDP step / step) and ``step_ratio`` (step / DDP step) to every successful row.

    The baseline is the DDP row of the same suite run (``run``), model, hosts and bandwidth; a row whose run
    has no such DDP row keeps the speedup computed earlier, if any.
    """

    def key(r: dict) -> tuple:
        return (r.get("run"), r.get("phase"), r.get("seed"), r["model"], r["hosts"], r["bandwidth"])

    ddp = {key(r): r["step_s"] for r in rows if r["system"] == "ddp" and r.get("status") == "ok"}
    for r in rows:
        base = ddp.get(key(r))
        if r.get("status") != "ok":
            r["speedup"] = r["step_ratio"] = None
        elif base is not None:
            r["speedup"], r["step_ratio"] = base / r["step_s"], r["step_s"] / base
        else:
            r.setdefault("speedup", None)
            r.setdefault("step_ratio", None)
    return rows


def check_goals(rows: list[dict]) -> list[dict]:
    """Evaluate :data:`GOALS` against ``rows`` (after :func:`add_speedups`); goals not run are left out."""
    out = []
    for text, model, hosts, bandwidth, system, kind, target in GOALS:
        match = [r for r in rows if (r["model"], r["hosts"], r["bandwidth"], r["system"]) ==
                 (model, hosts, bandwidth, system) and r.get("speedup") is not None]
        if not match:
            continue
        r = match[-1]
        value = r["speedup"] if kind == "speedup_min" else r["step_ratio"]
        met = value >= target if kind == "speedup_min" else value <= target
        out.append({"goal": text, "measured": round(value, 3), "target": target, "kind": kind, "met": met})
    return out


def _fmt(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def format_table(rows: list[dict]) -> str:
    """A fixed-width table of the rows, one line per run."""
    head = ["model", "hosts", "bandwidth", "system", "step ms", "samples/s", "speedup", "MB/step", "line %",
            "acc %", "compute", "compress", "comm", "wait", "status"]
    lines = [head]
    for r in rows:
        ok = r.get("status") == "ok"
        mb = _fmt(r.get("bytes_per_step"), ".1f", 1e-6) + ("~" if ok and r.get("bytes_approximate") else "")
        lines.append([
            r["model"], str(r["hosts"]), r["bandwidth"], r["system"],
            _fmt(r.get("step_s"), ".1f", 1e3), _fmt(r.get("samples_per_s"), ".1f"), _fmt(r.get("speedup"), ".2f"),
            mb if ok else "-", _fmt(r.get("line_rate"), ".0f", 100), _fmt(r.get("accuracy"), ".1f", 100),
            _fmt(r.get("compute_s"), ".0f", 1e3), _fmt(r.get("compress_s"), ".0f", 1e3),
            _fmt(r.get("communicate_s"), ".0f", 1e3), _fmt(r.get("wait_s"), ".0f", 1e3), r.get("status", "?"),
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in lines]
    text.insert(1, "-" * len(text[0]))
    text.append("phases in ms per step; ~ = loopback estimate; see docs/benchmarks_method.md for definitions")
    return "\n".join(text)


def format_markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table (step, samples/s, speedup, MB/step, line rate, accuracy, phases)."""
    head = ["model", "hosts", "bandwidth", "system", "step ms", "samples/s", "speedup", "MB/step", "line %",
            "acc %", "compute", "compress", "comm", "wait"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 4 + "---:|" * (len(head) - 4)]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r['hosts']} | {r['bandwidth']} | {r['system']} | "
                         f"{r.get('status')} |" + " |" * (len(head) - 5))
            continue
        cells = [r["model"], str(r["hosts"]), r["bandwidth"], r["system"], _fmt(r["step_s"], ".0f", 1e3),
                 _fmt(r.get("samples_per_s"), ".1f"), _fmt(r.get("speedup"), ".2f"),
                 _fmt(r.get("bytes_per_step"), ".1f", 1e-6) + ("~" if r.get("bytes_approximate") else ""),
                 _fmt(r.get("line_rate"), ".0f", 100), _fmt(r.get("accuracy"), ".1f", 100),
                 _fmt(r.get("compute_s"), ".0f", 1e3), _fmt(r.get("compress_s"), ".0f", 1e3),
                 _fmt(r.get("communicate_s"), ".0f", 1e3), _fmt(r.get("wait_s"), ".0f", 1e3)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_goals(goals: list[dict]) -> str:
    """One line per goal: measured value, target, met or missed."""
    lines = []
    for g in goals:
        unit = "x speedup" if g["kind"] == "speedup_min" else "x DDP step"
        lines.append(f"{'MET   ' if g['met'] else 'MISSED'} {g['goal']}: measured {g['measured']:.2f}{unit} "
                     f"(target {g['target']})")
    return "\n".join(lines)


def machine_info() -> dict:
    """What the numbers were measured on (the load average shows whether the machine was shared)."""
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "loadavg_1_5_15": list(os.getloadavg())}


def time_to_target_results(rows: list[dict], meta: dict) -> dict:
    """The time-to-accuracy combination of a ``--to-target`` run (benchmarks.to_target.to_target_table): the table,
    the validations and one recommendation per bandwidth; the GPU column needs docs/log/results/cost-model.json."""
    from benchmarks.cost import gpu_mapping
    try:
        fit = gpu_mapping.load_fit()
    except ValueError as exc:
        print(f"bagua-bench: no GPU-mapping column: {exc}", file=sys.stderr)
        fit = None
    cores = int(meta.get("machine", {}).get("cpus") or os.cpu_count() or 1)
    table = to_target_table.combine(rows, fit, meta.get("gpu_step"), cores)
    return {"table": table, "validation": to_target_table.validate(rows),
            "recommendations": to_target_table.recommend(table)}


def format_time_to_target(rows: list[dict], meta: dict, tt: Optional[dict] = None) -> str:
    """The combination as Markdown tables, then the validations and the recommendations (``tt``: the
    :func:`time_to_target_results` of ``rows``, when the caller has it already)."""
    tt = tt if tt is not None else time_to_target_results(rows, meta)
    parts = [to_target_table.format_markdown(tt["table"]), to_target_table.format_validation(tt["validation"]),
             "\n".join(tt["recommendations"])]
    return "\n\n".join(p for p in parts if p)


def speed_rows(rows: list[dict]) -> list[dict]:
    """The rows that measure step speed: all of a speed run, the ``step_time`` phase of a ``--to-target`` run."""
    return [r for r in rows if r.get("phase") in (None, "step_time")]


def _jsonable(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write_results(out_dir: str, name: str, rows: list[dict], meta: dict, make_plot: bool = True,
                  goals: Optional[list[dict]] = None) -> list[str]:
    """Write ``<name>.json`` and ``<name>.csv`` (and ``<name>.png``) under ``out_dir``; return the paths."""
    os.makedirs(out_dir, exist_ok=True)
    rows = to_target.add_time_speedups(add_speedups(rows))
    paths = [os.path.join(out_dir, f"{name}.{ext}") for ext in ("json", "csv")]
    with open(paths[0], "w") as f:
        data = {"meta": meta, "goals": goals if goals is not None else check_goals(rows), "results": rows}
        tt = time_to_target_results(rows, meta) if any(r.get("phase") for r in rows) else None
        if tt is not None:
            data["time_to_target"] = tt
        json.dump(data, f, indent=1, default=_jsonable)
    columns = ["model", "hosts", "bandwidth", "system", "status", "step_s", "mean_step_s", "samples_per_s", "speedup",
               "step_ratio", "bytes_per_step", "line_rate", "accuracy", "accuracy_min", "final_loss", "compute_s",
               "compress_s", "communicate_s", "wait_s", "timed_steps", "warmup", "emulated", "error"]
    if any("target_status" in r for r in rows):
        columns += to_target.COLUMNS
    if any(r.get("phase") for r in rows):
        columns += ["phase", "seed", "qadam_warmup"]
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in columns})
    return paths + render(os.path.join(out_dir, name), rows, meta, tt=tt, make_plot=make_plot)


def render(out: str, rows: list[dict], meta: dict, tt: Optional[dict] = None, make_plot: bool = True) -> list[str]:
    """Write what is drawn from ``rows``: ``<out>.png`` (speed against DDP), and for a ``--to-target`` run
    ``<out>-table.md``, ``<out>-vs-bandwidth.png`` (only when some system reached the target) and
    ``<out>-to-target.png``; return the paths. ``tt``: the :func:`time_to_target_results` of ``rows``, when the
    caller has it already."""
    paths = []
    speed = speed_rows(rows)
    if make_plot and any(r.get("status") == "ok" and r.get("speedup") is not None for r in speed):  # vs DDP
        paths.append(plot(speed, out + ".png", caption=caption_for(meta)))
    if any(r.get("phase") for r in rows):
        tt = tt if tt is not None else time_to_target_results(rows, meta)
        paths.append(out + "-table.md")
        with open(paths[-1], "w") as f:
            f.write(format_time_to_target(rows, meta, tt) + "\n")
        if make_plot and any(c["time_spread"].median < float("inf") for c in tt["table"]):
            paths.append(plot_time_vs_bandwidth(tt["table"], out + "-vs-bandwidth.png",
                                                caption=caption_for(meta, what="median of seeds, bars: range")))
    if make_plot and any(r.get("status") == "ok" and r.get("curve") for r in rows):
        paths.append(plot_to_target(rows, out + "-to-target.png",
                                    caption=caption_for(meta, what="metric every --eval-every steps")))
    return paths


def merge(paths: Sequence[str]) -> tuple[list[dict], dict]:
    """Concatenate the results of several suite runs (JSON files written by :func:`write_results`).

    Speedups are computed inside each run first, so they always compare with the DDP of the same run.
    """
    rows: list[dict] = []
    metas = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += add_speedups(combine_repeats(data["results"]))  # vs the DDP of the same run, before dedup
        metas += runs_of(data["meta"])
    # a configuration measured again (e.g. a failed run repeated) keeps its last successful result
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r.get("phase"), r.get("seed"), r["model"], r["hosts"], r["bandwidth"], r["system"])
        if key not in best or r.get("status") == "ok" or best[key].get("status") != "ok":
            best[key] = r
    rows = list(best.values())
    return add_speedups(rows), {"command": " && ".join(m.get("command", "") for m in metas), "runs": metas}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m benchmarks.common.report A.json B.json --out-dir D --name N``: merge runs into one table,
    JSON, CSV and plot (speedups stay relative to the DDP run of the same file and configuration).

    ``python -m benchmarks.common.report docs/log/results/X.json`` (no ``--name``) re-renders ``X.png`` (and, for a
    ``--to-target`` run, ``X-table.md``, ``X-to-target.png`` and, when some system reached the target,
    ``X-vs-bandwidth.png``) from the results already
    in ``X.json``, and writes nothing else: no benchmark is run again (a table whose wording changed, say).
    """
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.common.report", description=main.__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", help="JSON files written by bagua-bench")
    p.add_argument("--out-dir", default=None, help="where to write (default: beside the first input)")
    p.add_argument("--name", default=None, help="name of the merged results; without it: only re-render the plots and tables")
    p.add_argument("--markdown", action="store_true", help="also write <name>.md (a Markdown table)")
    args = p.parse_args(argv)
    if args.name is None:
        for path in args.inputs:
            rows, meta = merge([path])
            with open(path) as f:
                meta = json.load(f)["meta"]
            out = os.path.join(args.out_dir or os.path.dirname(path), os.path.splitext(os.path.basename(path))[0])
            for written in render(out, rows, meta):
                print("wrote " + written)
        return 0
    out_dir = args.out_dir or os.path.dirname(args.inputs[0])
    rows, meta = merge(args.inputs)
    if args.markdown:
        with open(os.path.join(out_dir, f"{args.name}.md"), "w") as f:
            f.write(format_markdown(rows) + "\n")
    goals = check_goals(rows)
    print(format_table(speed_rows(rows)))
    if any(r.get("phase") for r in rows):
        print("\n" + format_time_to_target(rows, meta))
    if goals:
        print()
        print(format_goals(goals))
    print("\nwrote " + ", ".join(write_results(out_dir, args.name, rows, meta, goals=goals)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
