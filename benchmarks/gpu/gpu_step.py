"""The benchmark models' training step on a GPU, measured: what the GPU-mapping column of the time-to-accuracy
table divides by (:mod:`benchmarks.cost.gpu_mapping`, ``GPU_STEP_S``).

One step is the suite's *compute* phase on one device: ``zero_grad``, forward, loss, backward, ``Adam.step`` and
reading the loss (``float(loss)``, which waits for the device, as every training loop that logs its loss does),
timed with ``time.perf_counter`` around the whole (:func:`benchmarks.common.measurements._step`, the function the
suite times). The batch is the suite's per-host batch (GPT 8 x 128 tokens, ResNet 32 digits of 8x8), so the step
is the per-GPU step of a GPU cluster with the same per-GPU batch; ``batch_scales`` also times it at that batch
times each factor, to show how launch-bound the small batch is. Inputs are random tokens or images of the right
shape (the step's cost does not depend on their values). ``precision="bf16"`` runs forward and loss under
``torch.autocast`` in bfloat16 (the gradients, and so what DDP sends, stay float32).

Run it with the GPU check (``benchmarks/gpu/gpu_check.sh OUT --stage install,step``) or alone::

    python -m benchmarks.gpu.gpu_step --models gpt,resnet --out step.json

Example (on CPU, the tiny GPT)::

    >>> row = measure("gpt_tiny", "cpu", steps=3, warmup=1)
    >>> row["model"], row["batch_size"], row["median_s"] > 0
    ('gpt_tiny', 4, True)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Optional, Sequence

import torch

from benchmarks.common.measurements import _step
from benchmarks.common.models import MODELS, build_model, loss_fn
from benchmarks.common.systems import _make_optimizer

__all__ = ["measure", "measure_all", "add_stage_arguments", "stage_step", "parse_args", "main"]


def _inputs(model: str, batch_size: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    spec = MODELS[model]
    if spec.data == "text":
        x = torch.randint(256, (batch_size, spec.in_shape[0] + 1), generator=gen)
        return x[:, :-1].to(device), x[:, 1:].to(device)
    x = torch.randn(batch_size, *spec.in_shape, generator=gen)
    y = (torch.randint(spec.out_dim, (batch_size,), generator=gen) if spec.classify
         else torch.randn(batch_size, spec.out_dim, generator=gen))
    return x.to(device), y.to(device)


def measure(model: str, device: str, steps: int = 50, warmup: int = 10, precision: str = "fp32",
            batch_scale: int = 1) -> dict:
    """Median seconds of ``steps`` training steps of ``model`` on ``device`` after ``warmup`` untimed ones, at the
    suite's per-host batch times ``batch_scale``, in ``precision`` (``fp32`` or ``bf16`` autocast)."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    if steps < 1 or warmup < 0 or batch_scale < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0, batch_scale >= 1; got {steps}, {warmup}, {batch_scale}")
    spec = MODELS[model]
    net = build_model(model, 0).to(device)
    optimizer = _make_optimizer(spec.optimizer, net.parameters(), spec.lr)
    batch_size = spec.batch_size * batch_scale
    gen = torch.Generator().manual_seed(0)
    batches = [_inputs(model, batch_size, device, gen) for _ in range(4)]
    compute_loss = loss_fn(spec)
    cast = (torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16) if precision == "bf16"
            else contextlib.nullcontext())
    times, losses = [], []
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        with cast:
            losses.append(_step(net, optimizer, compute_loss, x, y))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    times.sort()
    return {"model": model, "device": device, "precision": precision, "batch_size": batch_size,
            "batch_scale": batch_scale, "params": sum(p.numel() for p in net.parameters()), "steps": steps,
            "median_s": statistics.median(times), "p10_s": times[len(times) // 10],
            "p90_s": times[min(len(times) - 1, (9 * len(times)) // 10)], "last_loss": losses[-1]}


def measure_all(models: Sequence[str], device: str, steps: int, warmup: int, precisions: Sequence[str],
                batch_scales: Sequence[int], say=print) -> list[dict]:
    """:func:`measure` for every model, precision and batch scale, one line each through ``say``."""
    rows = []
    for model in models:
        for precision in precisions:
            for scale in batch_scales:
                row = measure(model, device, steps, warmup, precision, scale)
                rows.append(row)
                say(f"step: {device} {model} {precision} batch {row['batch_size']} (x{scale}): median "
                    f"{row['median_s'] * 1e3:.2f} ms [p10 {row['p10_s'] * 1e3:.2f}, p90 {row['p90_s'] * 1e3:.2f}] "
                    f"over {steps} steps")
    return rows


def add_stage_arguments(p: argparse.ArgumentParser) -> None:
    """The ``step`` stage's options of the GPU check."""
    p.add_argument("--step-models", default="gpt,resnet", help="models whose training step is timed (step stage)")
    p.add_argument("--step-steps", type=int, default=50, help="timed steps per row (step stage)")
    p.add_argument("--step-warmup", type=int, default=10, help="untimed steps before them (step stage)")
    p.add_argument("--step-batch-scales", default="1,8", help="factors of the suite's batch (step stage)")


def stage_step(run, args: argparse.Namespace) -> dict:
    """The GPU check's ``step`` stage (:mod:`benchmarks.gpu.gpu_check`): without CUDA, the same steps on CPU."""
    device = "cuda" if run.cuda else "cpu"
    if not run.cuda:
        run.skip_cuda("step", f"the models' training step on the GPU; timing {args.step_models} on cpu instead")
    models = [m.strip() for m in args.step_models.split(",") if m.strip()]
    scales = [int(s) for s in args.step_batch_scales.split(",")]
    rows = measure_all(models, device, args.step_steps, args.step_warmup, ["fp32", "bf16"], scales, run.say)
    return {"status": "ok", "device": device, "rows": rows}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.gpu_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,resnet", help="comma list of benchmark models")
    p.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    p.add_argument("--steps", type=int, default=50, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before them")
    p.add_argument("--precisions", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument("--batch-scales", default="1", help="comma list of factors of the suite's per-host batch")
    p.add_argument("--out", default=None, help="write the rows to this JSON file")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = measure_all(args.models.split(","), device, args.steps, args.warmup, args.precisions.split(","),
                       [int(s) for s in args.batch_scales.split(",")])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0) if device == "cuda" else device,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
