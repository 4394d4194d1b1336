"""Calibration of the cost model: the measured rows it is fitted on, and the fit (Nelder-Mead on the log error).

Part of :mod:`benchmarks.cost.cost_model`; the equations are in :mod:`benchmarks.cost.cost_equations`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from benchmarks.cost.cost_equations import SHAPES, Fit, Net, Step, codec_passes, predict

__all__ = ["CALIBRATION_FILES", "Case", "load_rows", "row_case", "case_net", "predict_case", "nelder_mead", "calibrate"]

#: The runs the model is calibrated on (docs/log/results): every system at 2 and 4 hosts. network.json merges the
#: first three, so it would only repeat their rows.
CALIBRATION_FILES = ("network-mlp-2hosts.json", "network-mlp-4hosts.json", "network-digits-2hosts.json",
                     "goals-bytegrad-2hosts.json", "goals-decentralized-4hosts.json")


@dataclass(frozen=True)
class Case:
    """One measured row, reduced to what the model needs."""

    source: str
    model: str
    hosts: int
    bandwidth: str
    system: str
    link_Bps: Optional[float]
    cores: int
    compute_s: float
    codec_s: Optional[float]
    memory_Bps: float
    step_s: float
    bytes_per_step: Optional[float]


def load_rows(paths: Sequence[str]) -> list[dict]:
    """The successful rows of the suite's JSON files, each with its ``source`` file and the machine's cores."""
    rows, seen = [], set()
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        cores = int(data.get("meta", {}).get("machine", {}).get("cpus") or 1)
        for row in data.get("results", []):
            key = (row.get("run"), row["model"], row["hosts"], row["bandwidth"], row["system"], row.get("repeat"))
            if row.get("status") != "ok" or row["model"] not in SHAPES or key in seen:
                continue
            seen.add(key)
            rows.append(dict(row, source=path.rsplit("/", 1)[-1], cores=cores))
    return rows


def row_case(row: dict, rows: Sequence[dict]) -> Case:
    """Reduce ``row`` to a :class:`Case`. The codec's memory rate (for PowerSGD, whose codec the suite does not
    time) comes from the measured MinMaxUInt8 codec of a ByteGrad row of the same run and configuration."""
    shapes = SHAPES[row["model"]]
    memory = 8e9
    for other in rows:
        same = all(other[k] == row[k] for k in ("source", "model", "hosts", "bandwidth"))
        if same and other["system"] == "bytegrad" and other.get("compress_s"):
            memory = codec_passes("bytegrad", row["hosts"]) * 4.0 * shapes.elements / other["compress_s"]
            break
    rate = row.get("rate_bps")
    return Case(row["source"], row["model"], row["hosts"], row["bandwidth"], row["system"],
                rate / 8 if rate else None, row["cores"], row["compute_s"], row.get("compress_s"), memory,
                row["step_s"], row.get("bytes_per_step"))


def case_net(case: Case, fit: Fit) -> Net:
    """The calibration host: one rank per emulated host; the hosts share the machine's cores."""
    share = min(1.0, case.cores / case.hosts)
    burst = 0.0 if case.link_Bps is None else max(case.link_Bps * 0.008, 256 * 1024)  # netns.tbf_burst_bytes
    return Net(hosts=case.hosts, link_Bps=case.link_Bps, stack_Bps=fit.stack_Bps * share,
               efficiency=fit.efficiency, latency_s=fit.latency_s, burst_bytes=burst, shared_core=True,
               memory_Bps=case.memory_Bps)


def predict_case(case: Case, fit: Fit) -> Step:
    """The model's step for a measured case under ``fit``."""
    return predict(case.system, SHAPES[case.model], case_net(case, fit), case.compute_s, fit.overlap,
                   codec_s=case.codec_s)


def nelder_mead(f: Callable[[list[float]], float], x0: Sequence[float], step: float = 0.5,
                iterations: int = 2000, tolerance: float = 1e-12) -> list[float]:
    """Minimize ``f`` from ``x0`` with the Nelder-Mead simplex (reflect 1, expand 2, contract 1/2, shrink 1/2)."""
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centre = [sum(x[j] for x in simplex[:-1]) / (len(simplex) - 1) for j in range(len(x0))]
        worst = simplex[-1]

        def towards(t: float) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centre, worst)]

        reflected = towards(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = towards(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = towards(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, xs)] for xs in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _unpack(x: Sequence[float]) -> Fit:
    return Fit(efficiency=_sigmoid(x[0]), stack_Bps=math.exp(x[1]), latency_s=math.exp(x[2]),
               overlap=_sigmoid(x[3]))


def calibrate(cases: Sequence[Case], start: Fit = Fit()) -> Fit:
    """Fit the four parameters to the cases: least squares of ``log(predicted step / measured step)``.

    Efficiency and overlap are fitted through a logistic (they stay in (0, 1)), bandwidth and latency through
    their logarithms (they stay positive)."""

    def loss(x: list[float]) -> float:
        fit = _unpack(x)
        return sum(math.log(predict_case(c, fit).step_s / c.step_s) ** 2 for c in cases)

    x = [_logit(start.efficiency), math.log(start.stack_Bps), math.log(start.latency_s), _logit(start.overlap)]
    for _ in range(3):  # restarts: a simplex can stall on the kinks of max(0, .)
        x = nelder_mead(loss, x)
    return _unpack(x)
