"""A step-time cost model of every benchmarked system, calibrated on the emulated-network runs and used to
predict the Bagua paper's setting (16 hosts of 8 GPUs at 10, 25 and 100 Gbit/s).

The model, per training step of one host (docs/cost_model.md has the equations with their reasons):

- a collective costs ``messages * latency + bytes_sent_per_host / bandwidth``, with ``bandwidth`` the link and
  the host's software stack in series: ``1 / (1 / (efficiency * link) + 1 / stack)``;
- the collectives each system issues (:func:`ring_allreduce`, :func:`scatter_gather_allreduce`,
  :func:`peer_exchange`, :func:`intra_node`) and the codec passes over the gradient it makes are in
  :func:`predict`;
- ``step = compute + codec + exposed communication``, where a gradient collective hides behind a fraction
  ``overlap`` of the compute (backward), decentralized SGD behind all of it (it starts at forward), and
  low-precision decentralized behind none (it runs after the optimizer step); async averages off the critical
  path.

Four parameters are fitted (:class:`Fit`): link efficiency, stack bandwidth per core, latency per message and
overlap. Compute and codec times come from the measured rows.

The code: the equations in :mod:`benchmarks.cost.cost_equations`, the fit in
:mod:`benchmarks.cost.cost_calibration`, the paper's setting in :mod:`benchmarks.cost.cost_paper`; this module
re-exports their names and holds the tables and the command line.

Example:
    >>> rows = load_rows(["docs/log/results/network-mlp-2hosts.json"])  # doctest: +SKIP
    >>> fit = calibrate(rows)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from typing import Optional, Sequence

from benchmarks.cost.cost_calibration import (
    CALIBRATION_FILES, Case, calibrate, case_net, load_rows, nelder_mead, predict_case, row_case,
)
from benchmarks.cost.cost_equations import (
    DECODE, ENCODE, FP16_CASTS, GBIT, POWERSGD_PASSES, SHAPES, Fit, Net, Shapes, Step, Traffic, bucket_count,
    codec_passes, intra_node, peer_exchange, powersgd_elements, predict, ring_allreduce, scatter_gather_allreduce,
    transfer_s,
)
from benchmarks.cost.cost_paper import (
    BAGUA_NET_BASELINE, PAPER, PAPER_GBITS, PAPER_GPUS, PAPER_HBM_BPS, PAPER_HOSTS, PAPER_LATENCY_S,
    PAPER_NVLINK_BPS, PAPER_SYSTEMS, PaperWorkload, paper_net, paper_prediction, paper_stack,
)

__all__ = [
    "Shapes", "SHAPES", "Net", "Fit", "Step", "ring_allreduce", "scatter_gather_allreduce", "peer_exchange",
    "intra_node", "bucket_count", "powersgd_elements", "codec_passes", "predict", "load_rows", "row_case",
    "calibrate", "nelder_mead", "paper_prediction", "PAPER", "main",
]
# Public before the split though never listed above; still importable from here.
__all__ += [
    "GBIT", "Traffic", "ENCODE", "DECODE", "FP16_CASTS", "POWERSGD_PASSES", "transfer_s", "CALIBRATION_FILES", "Case",
    "case_net", "predict_case", "PaperWorkload", "PAPER_HOSTS", "PAPER_GPUS", "PAPER_GBITS", "PAPER_LATENCY_S",
    "PAPER_NVLINK_BPS", "PAPER_HBM_BPS", "BAGUA_NET_BASELINE", "PAPER_SYSTEMS", "paper_net", "paper_stack",
]

# ------------------------------------------------------------------------------------------------------ CLI


def _default_files() -> list[str]:
    import os

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "log", "results")
    return [os.path.normpath(os.path.join(root, name)) for name in CALIBRATION_FILES]


def calibration_table(cases: Sequence[Case], fit: Fit) -> list[dict]:
    """Predicted against measured, one row per case."""
    table = []
    for c in cases:
        p = predict_case(c, fit)
        table.append(dict(source=c.source, model=c.model, hosts=c.hosts, bandwidth=c.bandwidth, system=c.system,
                          measured_ms=1e3 * c.step_s, predicted_ms=1e3 * p.step_s,
                          error=p.step_s / c.step_s - 1,
                          measured_mb=None if c.bytes_per_step is None else c.bytes_per_step / 1e6,
                          predicted_mb=p.bytes_per_host / 1e6))
    return table


def _print_calibration(fit: Fit, table: Sequence[dict], stack_check: Optional[float]) -> None:
    print("fitted parameters (least squares of log(predicted/measured) over every row):")
    print(f"  link efficiency        {fit.efficiency:.3f}  (TCP goodput / tbf rate)")
    print(f"  stack bandwidth        {fit.stack_Bps / 1e9:.3f} GB/s per core (gloo + TCP + Python on one core)")
    if stack_check:
        print(f"    cross-check: collectives-2ranks.json, 100 MB allreduce on loopback: {stack_check / 1e9:.3f} GB/s")
    print(f"  latency per message    {fit.latency_s * 1e6:.0f} us")
    print(f"  overlap                {fit.overlap:.3f}  (fraction of compute a gradient collective hides behind)")
    print()
    print(f"{'model':7} {'hosts':>5} {'bandwidth':>9} {'system':44} {'meas ms':>8} {'pred ms':>8} {'err':>6} "
          f"{'meas MB':>8} {'pred MB':>8}")
    for r in table:
        mb = "-" if r["measured_mb"] is None else f"{r['measured_mb']:.1f}"
        print(f"{r['model']:7} {r['hosts']:>5} {r['bandwidth']:>9} {r['system']:44} {r['measured_ms']:8.0f} "
              f"{r['predicted_ms']:8.0f} {100 * r['error']:+5.0f}% {mb:>8} {r['predicted_mb']:8.1f}")
    errors = [abs(r["error"]) for r in table]
    print(f"\n|error| over {len(errors)} rows: median {100 * statistics.median(errors):.0f} %, "
          f"max {100 * max(errors):.0f} %")
    by_system: dict[str, list[float]] = {}
    for r in table:
        by_system.setdefault(r["system"], []).append(abs(r["error"]))
    print("median |error| per system: " + ", ".join(
        f"{s} {100 * statistics.median(e):.0f} %" for s, e in sorted(by_system.items())))


def _print_paper(paper: dict) -> None:
    print(f"\nthe paper's setting: {PAPER_HOSTS} hosts x {PAPER_GPUS} V100, NVLink {paper['nvlink_Bps'] / 1e9:.0f} "
          f"GB/s inside, TCP between; stack {paper['stack_Bps'] / 1e9:.2f} GB/s per host (fitted to Bagua-Net's "
          f"DDP baseline), latency {paper['latency_s'] * 1e6:.0f} us per message, overlap {paper['overlap']:.2f}")
    for name, seconds in paper["compute_s"].items():
        print(f"  {name}: compute {1e3 * seconds:.0f} ms per step ({paper['sources'][name]})")
    systems = list(dict.fromkeys(r["system"] for r in paper["rows"]))
    for name in paper["compute_s"]:
        print(f"\n{name}: speedup over DDP (DDP step in ms), '*' = the algorithm the paper ran for this task")
        print(f"{'system':44} " + " ".join(f"{g:>8} Gb" for g in PAPER_GBITS))
        for system in systems:
            cells = [r for r in paper["rows"] if r["workload"] == name and r["system"] == system]
            mark = "*" if cells[0]["bagua_pick"] else " "
            text = " ".join(f"{r['speedup']:10.2f}" if system != "ddp" else f"{1e3 * r['step_s']:8.0f}ms"
                            for r in cells)
            print(f"{mark}{system:43} {text}")
        print(f"  published: {paper['published'][name]}")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Fit the model on the measured runs, print predicted against measured, and predict the paper's setting."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost.cost_model", description=main.__doc__)
    parser.add_argument("files", nargs="*", help="suite JSON files (default: the calibration runs in docs/log/results)")
    parser.add_argument("--json", metavar="OUT", help="also write the fit, the table and the prediction here")
    parser.add_argument("--paper-compute", action="append", default=[], metavar="MODEL=SECONDS",
                        help="override a paper workload's per-GPU compute step, e.g. vgg16=0.25")
    parser.add_argument("--paper-overlap", type=float, metavar="FRACTION",
                        help="overlap of communication with backward at the paper's scale (default: the fitted one)")
    args = parser.parse_args(argv)
    compute = {}
    for item in args.paper_compute:
        name, _, value = item.partition("=")
        if name not in PAPER or not value:
            parser.error(f"--paper-compute {item!r}: expected MODEL=SECONDS with MODEL in {', '.join(PAPER)}")
        compute[name] = float(value)
    files = args.files or _default_files()
    rows = load_rows(files)
    if not rows:
        parser.error(f"no usable rows (models {', '.join(m for m in SHAPES if m in ('mlp', 'digits'))}) in {files}")
    cases = [row_case(r, rows) for r in rows]
    fit = calibrate(cases)
    table = calibration_table(cases, fit)
    stack_check = _collectives_check(files)
    _print_calibration(fit, table, stack_check)
    if args.paper_overlap is not None and not 0 <= args.paper_overlap <= 1:
        parser.error(f"--paper-overlap {args.paper_overlap}: a fraction of the compute, between 0 and 1")
    paper = paper_prediction(fit, compute, args.paper_overlap)
    _print_paper(paper)
    errors = [abs(r["error"]) for r in table]
    result = dict(fit=asdict(fit), files=[f.rsplit("/", 1)[-1] for f in files], calibration=table,
                  median_abs_error=statistics.median(errors), max_abs_error=max(errors), paper=paper,
                  stack_check_Bps=stack_check)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.json}")
    return result


def _collectives_check(files: Sequence[str]) -> Optional[float]:
    """Bytes/s one rank sent in the 100 MB allreduce of collectives-2ranks.json (2 ranks send ``nbytes`` each),
    an independent reading of the stack bandwidth; None when the file is not beside the calibration files."""
    import os

    path = os.path.join(os.path.dirname(files[0]) if files else ".", "collectives-2ranks.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        results = json.load(f)["results"]
    times = [r for r in results if r["op"] == "torch.all_reduce SUM" and r["bytes"] >= 1e8]
    return times[0]["bytes"] / times[0]["median_s"] if times else None


if __name__ == "__main__":
    main()
