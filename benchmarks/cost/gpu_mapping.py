"""Which GPU setting an emulated bandwidth stands for: DDP's communication-to-compute ratio, mapped with the cost
model onto nodes of 8 H100.

A step here computes about 100x slower than on a GPU, so "100 Mbit/s" on this machine does not mean what it means
to a GPU user. What carries over is the ratio of DDP's communication to its compute:

    ratio = allreduce_s(model, hosts, link) / compute_s

with ``allreduce_s`` one uncompressed ring allreduce of the model's fp32 gradient over the hosts, from the cost
model (:mod:`benchmarks.cost.cost_equations`: ``buckets * 2 (n-1) * latency + transfer``, with the link and the
host's software stack in series, parameters fitted on the emulated runs, docs/cost_model.md) and ``compute_s`` the
measured step of an unwrapped replica of the model (the suite's *compute* column).

The GPU setting with the same ratio: ``hosts`` nodes of :data:`GPUS_PER_NODE` GPUs, DDP ringing over all ranks,
so each node's network interface carries ``2 (p-1)/p`` of the gradient (p = 8 x hosts), per-GPU compute
:data:`GPU_STEP_S` (same model, same per-GPU batch), message latency :data:`GPU_LATENCY_S`, TCP efficiency the
fitted one. Solving ``ratio = (messages * latency + bytes / (efficiency * link)) / gpu_step`` for the link gives
the node bandwidth at which a GPU user sees what this machine sees (:func:`gpu_link_gbits`); None when the ratio
is below what latency alone costs on the GPU nodes (no link is fast enough).

Example:
    >>> fit = Fit(efficiency=0.95, stack_Bps=0.73e9, latency_s=1.9e-3, overlap=0.0)
    >>> comm, ratio = ddp_comm_ratio(10_800_000, 2, 100_000_000, 0.75, fit, cores=2)
    >>> round(comm, 1), round(ratio, 1)
    (3.6, 4.9)
    >>> round(gpu_link_gbits(ratio, 10_800_000, 2, 0.00877, fit))
    16
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from benchmarks.cost.cost_equations import GBIT, Fit, Net, ring_allreduce, transfer_s

__all__ = ["GPUS_PER_NODE", "GPU_LATENCY_S", "GPU_STEP_S", "GPU_STEP_SOURCES", "DDP_BUCKET_BYTES", "load_fit",
           "gpu_step_s", "ddp_comm_ratio", "gpu_link_gbits", "describe"]

GPUS_PER_NODE = 8
GPU_LATENCY_S = 20e-6  # assumed, as for the paper's data centre (cost_paper.PAPER_LATENCY_S)
DDP_BUCKET_BYTES = 25 * 2**20

#: Per-GPU compute of one step (forward, backward, Adam, reading the loss) on an H100 at the suite's per-host batch
#: in float32: MEASURED on one H100 80GB HBM3, torch 2.11, 2026-11-26 (median of 60 steps,
#: ``benchmarks/gpu/gpu_check.sh OUT --stage install,step``; docs/gpu.md). Override with ``--gpu-step MODEL=SECONDS``.
GPU_STEP_S: dict[str, float] = {"gpt": 8.77e-3, "resnet": 4.12e-3}
GPU_STEP_SOURCES: dict[str, str] = {
    "gpt": "measured: H100, fp32, 8 x 128 tokens, median of 60 steps 8.77 ms (launch-bound: 17.9 ms at 8x the "
           "batch, 59.5 ms at 32x; bf16 autocast 13.3 ms at this batch)",
    "resnet": "measured: H100, fp32, batch 32 of 8x8 digits, median of 60 steps 4.12 ms (launch-bound: 5.57 ms at "
              "32x the batch); other models: the CPU step / 100",
}


def gpu_step_s(model: str, cpu_compute_s: float, overrides: Optional[dict[str, float]] = None) -> float:
    """The H100 step of ``model``: ``overrides``, then :data:`GPU_STEP_S`, else the CPU step / 100."""
    table = {**GPU_STEP_S, **(overrides or {})}
    return table.get(model, cpu_compute_s / 100)


def load_fit(path: Optional[str] = None) -> Fit:
    """The cost model's fitted parameters from ``docs/log/results/cost-model.json`` (written by
    ``python -m benchmarks.cost.cost_model --json``)."""
    if path is None:
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.normpath(os.path.join(here, "..", "..", "docs", "log", "results", "cost-model.json"))
    try:
        with open(path) as f:
            return Fit(**json.load(f)["fit"])
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"no cost-model fit at {path} ({exc}); write it with "
                         f"python -m benchmarks.cost.cost_model --json {path}") from None


def ddp_comm_ratio(params: int, hosts: int, rate_bps: Optional[int], compute_s: float, fit: Fit,
                   cores: int) -> tuple[float, float]:
    """(seconds of one uncompressed ring allreduce of ``params`` fp32 values over ``hosts`` emulated hosts,
    that divided by ``compute_s``). ``rate_bps`` None: unshaped (the stack alone, which the hosts' ``cores``
    share)."""
    if compute_s <= 0:
        raise ValueError(f"compute_s must be positive, got {compute_s}")
    grad = 4.0 * params
    net = Net(hosts=hosts, link_Bps=None if rate_bps is None else rate_bps / 8,
              stack_Bps=fit.stack_Bps * min(1.0, cores / hosts), efficiency=fit.efficiency, latency_s=fit.latency_s)
    traffic = ring_allreduce(grad, hosts)
    buckets = max(1, math.ceil(grad / DDP_BUCKET_BYTES))
    comm = buckets * traffic.messages * fit.latency_s + transfer_s(net, traffic.bytes, 0.0)
    return comm, comm / compute_s


def gpu_link_gbits(ratio: float, params: int, hosts: int, gpu_step: float, fit: Fit,
                   gpus: int = GPUS_PER_NODE) -> Optional[float]:
    """Gbit/s per node at which DDP on ``hosts`` nodes of ``gpus`` GPUs (per-GPU step ``gpu_step``) has the
    communication-to-compute ``ratio``; None when latency alone exceeds it."""
    grad = 4.0 * params
    traffic = ring_allreduce(grad, hosts * gpus)
    buckets = max(1, math.ceil(grad / DDP_BUCKET_BYTES))
    wire_s = ratio * gpu_step - buckets * traffic.messages * GPU_LATENCY_S
    if wire_s <= 0:
        return None
    return traffic.bytes / (fit.efficiency * wire_s) / GBIT


def describe(ratio: float, gbits: Optional[float], hosts: int) -> str:
    """One cell: the ratio and the GPU setting it corresponds to."""
    where = f"{hosts} x {GPUS_PER_NODE} H100"
    if gbits is None:
        return f"{ratio:.2g} (below {where}'s latency floor)"
    link = f"{gbits:.0f} Gbit/s" if gbits >= 10 else f"{gbits:.2g} Gbit/s"
    return f"{ratio:.2g} = {where} at {link}"
