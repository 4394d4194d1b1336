"""Time to target per network from steps measured once and step times measured per bandwidth, over seeds.

The suite's ``--to-target`` runs (:mod:`benchmarks.to_target.to_target_plan`) leave rows of four phases:

- ``convergence``: a synchronous system trained to the target on unshaped links, once per seed. Its trajectory
  does not depend on the link, so its *steps to target* hold at every bandwidth;
- ``step_time``: a short timed run of every synchronous system at every bandwidth (seed 0). Its *mean* step
  (not the median: a local-update system communicates on one step in ``period``) is the cost of a step there;
- ``real``: a system whose trajectory depends on timing (asynchronous averaging, anything overlapping
  communication with later steps) trained to the target for real at every bandwidth, once per seed;
- ``validation``: one synchronous system trained to the target for real at one shaped bandwidth, to check
  the combination (:func:`validate`).

:func:`combine` joins them: for a synchronous system, per seed,

    time to target = warmup * DDP's step + (steps - warmup) * the system's step

(``warmup``: the steps a system runs as plain DDP first: QAdam's full-precision warmup, PowerSGD's two vanilla
allreduce steps, post-local SGD's ``warmup``; :func:`time_to_target`). The seeds give a median and a spread
(:class:`Spread`; a seed that missed the target counts as infinitely slow), and a system counts as faster or
slower than DDP only when its whole spread is (:func:`compare`). Each (model, hosts, bandwidth) also gets DDP's
communication-to-compute ratio and the GPU setting with the same ratio (:mod:`benchmarks.cost.gpu_mapping`).

Example:
    >>> spread([300, 280, None]).median, compare(spread([10, 11, 12]), spread([13, 14, 20]))
    (300, 'faster')
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence
from benchmarks.cost import gpu_mapping
from benchmarks.cost.cost_equations import Fit

__all__ = ["Spread", "spread", "compare", "time_to_target", "warmup_steps", "combine", "validate",
           "recommend", "format_markdown", "format_validation", "VALIDATION_TOLERANCE"]

#: the combination agrees with a real run when their times differ by at most this fraction
VALIDATION_TOLERANCE = 0.10


@dataclass(frozen=True)
class Spread:
    """The seeds of one measurement: median, lowest and highest value, how many seeds, how many missed
    (a missed seed is ``inf``: never reached)."""

    median: float
    low: float
    high: float
    n: int
    missed: int = 0

    def cell(self, spec: str = ".0f") -> str:
        """``median [low-high]``, ``>budget`` parts written as ``-``."""
        def f(v: float) -> str:
            return "not reached" if math.isinf(v) else format(v, spec)

        if self.n == 1 or self.low == self.high:
            return f(self.median)
        return f"{f(self.median)} [{f(self.low)}-{f(self.high)}]"


def spread(values: Sequence[Optional[float]]) -> Spread:
    """Median and range of per-seed ``values``; ``None`` (target not reached) counts as ``inf``."""
    if not values:
        raise ValueError("spread of no seeds; run at least one seed")
    xs = [math.inf if v is None else v for v in values]
    return Spread(statistics.median(xs), min(xs), max(xs), len(xs), sum(v is None for v in values))


def compare(a: Spread, b: Spread) -> str:
    """``faster`` when all of ``a``'s seeds beat all of ``b``'s (lower is better), ``slower`` when all lose,
    else ``within spread``: only a whole spread counts."""
    if a.high < b.low:
        return "faster"
    if a.low > b.high:
        return "slower"
    return "within spread"


def time_to_target(steps: Optional[int], step_s: float, warmup: int = 0,
                   warmup_step_s: Optional[float] = None) -> Optional[float]:
    """``warmup`` steps at ``warmup_step_s`` then the rest at ``step_s``; None when ``steps`` is (not reached)."""
    if steps is None:
        return None
    if step_s <= 0 or steps < 0:
        raise ValueError(f"steps ({steps}) and step_s ({step_s}) must be positive")
    warm = min(warmup, steps) if warmup_step_s is not None else 0
    return warm * warmup_step_s + (steps - warm) * step_s if warm else steps * step_s


def warmup_steps(system: str, qadam_warmup: Optional[int]) -> int:
    """Steps ``system`` runs as plain gradient allreduce before its own scheme (timed at DDP's step)."""
    from benchmarks.common.systems import POST_LOCAL_SGD_DEFAULTS, split_system

    name, kwargs = split_system(system)
    if name == "qadam":
        return qadam_warmup or 0
    if name == "ddp_powersgd":
        return 2  # start_powerSGD_iter (systems.make_system)
    if name == "ddp_post_local_sgd":
        return int(kwargs.get("warmup", POST_LOCAL_SGD_DEFAULTS["warmup"]))
    return 0


def _ok(rows: Sequence[dict], phase: str) -> list[dict]:
    return [r for r in rows if r.get("phase") == phase and r.get("status") == "ok"]


def _by_seed(rows: Sequence[dict], key: str) -> dict[int, Optional[float]]:
    return {r.get("seed", 0): r.get(key) for r in rows}


def combine(rows: Sequence[dict], fit: Optional[Fit] = None, gpu_steps: Optional[dict[str, float]] = None,
            cores: int = 2) -> list[dict]:
    """One row per (model, hosts, bandwidth, system): steps and time to target over seeds, the method, vs DDP,
    and DDP's communication-to-compute ratio with its GPU setting (when ``fit`` is given)."""
    conv, steps_rows, real = _ok(rows, "convergence"), _ok(rows, "step_time"), _ok(rows, "real")
    out = []
    configs = sorted({(r["model"], r["hosts"]) for r in conv + real})
    for model, hosts in configs:
        mine = [r for r in steps_rows + real if (r["model"], r["hosts"]) == (model, hosts)]
        bands = {r["bandwidth"]: r.get("rate_bps") for r in mine}
        systems = list(dict.fromkeys(r["system"] for r in conv + real if (r["model"], r["hosts"]) == (model, hosts)))
        for band, rate in bands.items():
            step = _median_rows([r for r in steps_rows if (r["model"], r["hosts"], r["bandwidth"]) ==
                                 (model, hosts, band)])
            ddp_step = step.get("ddp", {}).get("mean_step_s")
            cells = []
            for system in systems:
                runs = [r for r in real if (r["model"], r["hosts"], r["bandwidth"], r["system"]) ==
                        (model, hosts, band, system)]
                if runs:
                    seeds = _by_seed(runs, "steps_to_target")
                    times = _by_seed(runs, "time_to_target_s")
                    method, step_s = "real run", None
                else:
                    done = [r for r in conv if (r["model"], r["hosts"], r["system"]) == (model, hosts, system)]
                    if not done or system not in step:
                        continue
                    step_s = step[system]["mean_step_s"]
                    seeds = _by_seed(done, "steps_to_target")
                    warm = {r.get("seed", 0): warmup_steps(system, r.get("qadam_warmup")) for r in done}
                    times = {s: time_to_target(n, step_s, warm[s], ddp_step if ddp_step else None)
                             for s, n in seeds.items()}
                    method = "steps x step"
                cells.append(dict(model=model, hosts=hosts, bandwidth=band, rate_bps=rate, system=system,
                                  method=method, seeds=sorted(seeds), steps=[seeds[s] for s in sorted(seeds)],
                                  step_s=step_s, times_s=[times[s] for s in sorted(seeds)]))
            _add_spreads(cells)
            mapping = _mapping(step.get("ddp"), model, hosts, rate, fit, gpu_steps, cores)
            for c in cells:
                c.update(mapping)
            out += cells
    return out


def _median_rows(rows: Sequence[dict]) -> dict[str, dict]:
    """Per system, its step-time row with the median mean step (the lower middle one of an even count): timed
    runs repeated, or merged from several suite runs, count alike."""
    by_system: dict[str, list[dict]] = {}
    for r in rows:
        by_system.setdefault(r["system"], []).append(r)
    return {s: sorted(rs, key=lambda r: r["mean_step_s"])[(len(rs) - 1) // 2] for s, rs in by_system.items()}


def _add_spreads(cells: list[dict]) -> None:
    for c in cells:
        c["steps_spread"], c["time_spread"] = spread(c["steps"]), spread(c["times_s"])
    ddp = next((c for c in cells if c["system"] == "ddp"), None)
    for c in cells:
        if ddp is None:
            c["vs_ddp"], c["verdict"] = None, None
            continue
        mine, base = c["time_spread"].median, ddp["time_spread"].median
        c["vs_ddp"] = base / mine if math.isfinite(mine) and math.isfinite(base) else None
        c["verdict"] = "reference" if c is ddp else compare(c["time_spread"], ddp["time_spread"])


def _mapping(ddp: Optional[dict], model: str, hosts: int, rate: Optional[int], fit: Optional[Fit],
             gpu_steps: Optional[dict[str, float]], cores: int) -> dict:
    if ddp is None or fit is None or not ddp.get("compute_s"):
        return dict(ddp_comm_ratio=None, ddp_comm_ratio_measured=None, gpu_gbits=None, gpu_setting=None)
    compute = ddp["compute_s"]
    _, ratio = gpu_mapping.ddp_comm_ratio(ddp["params"], hosts, rate, compute, fit, cores)
    gpu_step = gpu_mapping.gpu_step_s(model, compute, gpu_steps)
    gbits = gpu_mapping.gpu_link_gbits(ratio, ddp["params"], hosts, gpu_step, fit)
    return dict(ddp_comm_ratio=ratio, ddp_comm_ratio_measured=max(ddp["mean_step_s"] - compute, 0.0) / compute,
                gpu_step_s=gpu_step, gpu_gbits=gbits, gpu_setting=gpu_mapping.describe(ratio, gbits, hosts))


def validate(rows: Sequence[dict]) -> list[dict]:
    """Each real run of a synchronous system (the ``validation`` phase, and the unshaped ``convergence`` runs)
    against steps x step time at its bandwidth: ``ratio`` = real / combined, ``agrees`` within
    :data:`VALIDATION_TOLERANCE`."""
    conv, step_rows = _ok(rows, "convergence"), _ok(rows, "step_time")
    out = []
    for r in _ok(rows, "validation") + conv:
        key = (r["model"], r["hosts"], r["system"])
        def timed(system: str) -> list[dict]:
            return [s for s in step_rows if (s["model"], s["hosts"], s["system"], s["bandwidth"]) ==
                    key[:2] + (system, r["bandwidth"])]

        step, ddp = timed(r["system"]), timed("ddp")
        steps = [c["steps_to_target"] for c in conv if (c["model"], c["hosts"], c["system"]) == key
                 and c.get("seed", 0) == r.get("seed", 0)]
        if not step or not steps or steps[0] is None or r.get("time_to_target_s") is None:
            continue
        warm = warmup_steps(r["system"], r.get("qadam_warmup"))
        combined = time_to_target(steps[0], step[0]["mean_step_s"], warm, ddp[0]["mean_step_s"] if ddp else None)
        ratio = r["time_to_target_s"] / combined
        out.append(dict(model=r["model"], hosts=r["hosts"], bandwidth=r["bandwidth"], system=r["system"],
                        seed=r.get("seed", 0), phase=r["phase"], real_steps=r["steps_to_target"],
                        steps=steps[0], real_s=r["time_to_target_s"], combined_s=combined, ratio=ratio,
                        agrees=abs(ratio - 1) <= VALIDATION_TOLERANCE))
    return out


def recommend(table: Sequence[dict]) -> list[str]:
    """One sentence per (model, hosts, bandwidth): the system to pick there, the quickest on the median of those
    faster than DDP on every seed and measured on at least as many seeds as DDP (DDP when none is), naming a
    quicker median that is within DDP's spread and a system faster on fewer seeds than DDP's."""
    out = []
    for key in dict.fromkeys((c["model"], c["hosts"], c["bandwidth"]) for c in table):
        cells = [c for c in table if (c["model"], c["hosts"], c["bandwidth"]) == key]
        first = min(cells, key=lambda c: c["time_spread"].median)
        seeds = max((c["time_spread"].n for c in cells if c["system"] == "ddp"), default=1)
        faster = [c for c in cells if c["system"] != "ddp" and c.get("verdict") == "faster"]
        few = [c for c in faster if c["time_spread"].n < seeds]
        faster = [c for c in faster if c["time_spread"].n >= seeds]
        best = min(faster, key=lambda c: c["time_spread"].median) if faster else None
        where = f"{key[0]}, {key[1]} hosts, {key[2]}"
        ahead = ("" if first["system"] == "ddp" or first is best or first in few
                 else f" ({first['system']} is ahead on the median only, within DDP's spread)")
        ahead += "".join(f" ({c['system']} is faster on its {c['time_spread'].n} seed(s), fewer than DDP's {seeds}: "
                         "not counted)" for c in few
                         if best is None or c["time_spread"].median < best["time_spread"].median)
        if not math.isfinite(first["time_spread"].median):
            out.append(f"{where}: no system reached the target.")
        elif best is None:
            out.append(f"{where}: DDP; nothing is faster on every seed{ahead}.")
        else:
            close = [c["system"] for c in cells if c is not best and compare(best["time_spread"], c["time_spread"])
                     != "faster"]
            ratio = (f"{best['vs_ddp']:.2f}x DDP's time to target on the median" if best["vs_ddp"] is not None
                     else "DDP did not reach the target")
            out.append(f"{where}: {best['system']}, {ratio}, faster than DDP on every seed; within its spread: "
                       f"{', '.join(close) or 'none'}{ahead}.")
    return out


def format_markdown(table: Sequence[dict]) -> str:
    """Per (model, hosts): a Markdown table, a row per system and a column per bandwidth; a cell is the median
    time to target in seconds [lowest-highest seed] and the ratio vs DDP; ``*`` marks a real run, ``+``/``-``
    a whole spread faster/slower than DDP's; the last row is DDP's communication-to-compute ratio and its GPU
    setting."""
    text = []
    for model, hosts in dict.fromkeys((c["model"], c["hosts"]) for c in table):
        cells = [c for c in table if (c["model"], c["hosts"]) == (model, hosts)]
        bands = list(dict.fromkeys(c["bandwidth"] for c in cells))
        head = ["system", "steps (median [range])"] + [f"{b}: time s" for b in bands]
        lines = [f"**{model}, {hosts} hosts**", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for system in dict.fromkeys(c["system"] for c in cells):
            mine = {c["bandwidth"]: c for c in cells if c["system"] == system}
            steps = next((c["steps_spread"].cell() for c in mine.values() if c["method"] != "real run"), "real runs")
            row = [system, steps]
            for b in bands:
                c = mine.get(b)
                if c is None:
                    row.append("-")
                    continue
                mark = {"faster": " +", "slower": " -"}.get(c["verdict"] or "", "")
                vs = f" ({c['vs_ddp']:.2f}x)" if c["vs_ddp"] else ""
                row.append(c["time_spread"].cell(".1f") + vs + mark + (" *" if c["method"] == "real run" else ""))
            lines.append("| " + " | ".join(row) + " |")
        setting = {c["bandwidth"]: c.get("gpu_setting") or "-" for c in cells}
        lines.append("| DDP comm / compute = GPU setting | | " + " | ".join(setting[b] for b in bands) + " |")
        text.append("\n".join(lines))
    return "\n\n".join(text)


def format_validation(checks: Sequence[dict]) -> str:
    """One line per check: real and combined time, their ratio, and whether they agree.

    Requested validations (``--validate``, the ``validation`` phase) say ``agrees`` or ``DISAGREES``. The
    convergence runs' own clocks are only cross-checks: those runs are meant to be run beside other work (their
    steps do not depend on load), so a ratio above 1 there says the machine was busy, not that the method failed.
    """
    def verdict(c: dict) -> str:
        if c["phase"] == "validation":
            return f"{'agrees' if c['agrees'] else 'DISAGREES'} (tolerance {VALIDATION_TOLERANCE:.0%})"
        return ("within" if c["agrees"] else "outside") + (
            f" {VALIDATION_TOLERANCE:.0%}; cross-check only: the convergence run's own clock, which counts any "
            "work run beside it")

    return "\n".join(
        f"{c['model']} {c['hosts']} hosts {c['bandwidth']} {c['system']} seed {c['seed']} ({c['phase']}): real "
        f"{c['real_s']:.1f} s in {c['real_steps']} steps, steps x step {c['combined_s']:.1f} s in {c['steps']} "
        f"steps: ratio {c['ratio']:.3f}, {verdict(c)}" for c in checks)
