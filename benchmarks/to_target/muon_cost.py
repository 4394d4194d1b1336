"""What Muon's inner step costs on the time-to-target benchmark's GPT, against the step it would replace.

Muon (torch.optim.Muon, torch >= 2.9) orthogonalizes each hidden weight matrix's update with 5 Newton-Schulz
iterations, three matrix products each. At the benchmark's batch (8 windows of 128 tokens per rank) those
products are of the same order as the forward and backward pass itself, which a large batch would dwarf. This
script times, in one process, the forward + backward at the benchmark's per-rank batch,
an Adam step on the whole model, torch's Muon step on the hidden matrices (its iteration runs in bfloat16), and
the same iteration written in float32, and prints the median of ``--reps`` timings of each
against forward + backward's, timed in the same run.

Run::

    python -m benchmarks.to_target.muon_cost --reps 3 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from benchmarks.common.gpt import lm_loss
from benchmarks.common.models import MODELS, build_model
from benchmarks.common.systems import MUON_LR, _inner_optimizers

__all__: list[str] = []

_NS = (3.4445, -4.775, 2.0315)  # the quintic iteration's coefficients (torch's and Keller Jordan's)


def newton_schulz_float32(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The orthogonalization torch's Muon runs in bfloat16, in float32: ``x <- a x + (b A + c A^2) x`` with
    ``A = x x^T`` on the wide orientation of ``g / ||g||``."""
    a, b, c = _NS
    x = g.float()
    tall = x.size(0) > x.size(1)
    x = (x.T if tall else x) / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _median_s(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="timings of each part (median)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the benchmark's ranks use 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model("gpt")
    spec = MODELS["gpt"]
    tokens = torch.randint(0, 256, (spec.batch_size, spec.in_shape[0] + 1))
    muon, _ = _inner_optimizers("muon", model, spec.lr)  # Muon on the hidden matrices, Adam on the rest
    matrices = [p for group in muon.param_groups for p in group["params"]]

    def fwd_bwd() -> None:
        model.zero_grad()
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()

    fwd_bwd()  # gradients for the optimizers; warms the kernels
    whole_adam = torch.optim.Adam(model.parameters(), lr=spec.lr)
    parts = {"forward + backward (batch 8 x 128)": fwd_bwd, "Adam step, whole model": whole_adam.step,
             f"torch Muon step, {len(matrices)} hidden matrices (bfloat16 iteration, lr {MUON_LR})": muon.step,
             "the same iteration in float32": lambda: [newton_schulz_float32(p.grad) for p in matrices]}
    medians = {name: _median_s(fn, args.reps) for name, fn in parts.items()}
    base = medians["forward + backward (batch 8 x 128)"]
    for name, s in medians.items():
        print(f"{name:<75} {s:8.3f} s  {s / base:6.2f}x forward + backward")


if __name__ == "__main__":
    main()
