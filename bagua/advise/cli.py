"""``python -m bagua.advise``: time the step, probe the link, print the measured tables' pick (rank 0 only).

Run one process per node under a launcher (torchrun, ``python -m bagua.distributed.run``); the advisor joins the
launcher's rendezvous (``env://``) with gloo on CPU or NCCL on CUDA, and sends its probes in a process group of
its own. See docs/advise.md.

Example:
    >>> args = build_parser().parse_args(["--params", "1000", "--sizes", "4KiB,1MiB"])
    >>> args.sizes, args.params
    ([4096, 1048576], 1000)
"""

from __future__ import annotations

import argparse
import importlib
import json
import runpy
import statistics
import sys
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from bagua.advise.measure import (fit_link, format_size, max_over_ranks, parse_size, probe_allreduce,
                                  synthetic_step, time_step)
from bagua.advise.pick import format_rate, recommend
from bagua.advise.table import GPT_PARAMS
from bagua.torch_api import env
from bagua.torch_api.comm.cost import ring_allreduce_bytes

__all__ = ["build_parser", "load_step", "advise", "format_report", "main"]

DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB,64MiB"


def _sizes(text: str) -> list[int]:
    try:
        return sorted({parse_size(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """Return the advisor's argument parser."""
    p = argparse.ArgumentParser(prog="python -m bagua.advise", description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--step", metavar="MODULE:CALLABLE", help="time this callable (importable from the cwd)")
    what.add_argument("--script", metavar="PATH", help="time the step() a Python file defines")
    p.add_argument("--params", type=int, help="parameters DDP would allreduce (4 bytes each); default: the "
                   "module's or script's `model`, or, for the synthetic step, the benchmark GPT's 10.8 M")
    p.add_argument("--model-bytes", type=int, help="gradient bytes per step, instead of --params")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps; their median counts (default 10)")
    p.add_argument("--sizes", type=_sizes, default=_sizes(DEFAULT_SIZES),
                   help=f"allreduce sizes to probe (default {DEFAULT_SIZES})")
    p.add_argument("--probe-repeats", type=int, default=5, help="timed allreduces per size (default 5)")
    p.add_argument("--max-probe-s", type=float, default=2.0,
                   help="skip sizes predicted to take longer than this per allreduce (default 2 s)")
    p.add_argument("--hosts", type=int, help="hosts to recommend for (default: the number of processes)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the probe's tensors live: cuda uses NCCL, cpu gloo (default: cuda if available)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    return p


def load_step(step: Optional[str], script: Optional[str]) -> tuple[Callable[[], object], dict, str]:
    """Return (the step callable, the namespace it came from, a description) for ``--step`` or ``--script``."""
    if script is not None:
        namespace = runpy.run_path(script, run_name="__bagua_advise__")
        fn, where = namespace.get("step"), f"step() of {script}"
    else:
        assert step is not None
        module_name, _, attr = step.partition(":")
        if not attr:
            raise ValueError(f"--step {step!r} must be MODULE:CALLABLE, e.g. train:step")
        module = importlib.import_module(module_name)
        namespace, fn, where = vars(module), module, f"{step}"
        for part in attr.split("."):
            fn = getattr(fn, part, None)
    if not callable(fn):
        raise ValueError(f"{where} is not a callable; define `def step(): ...` (one training step) there")
    return fn, namespace, where


def _model_bytes(args: argparse.Namespace, namespace: dict) -> tuple[Optional[int], str]:
    if args.model_bytes is not None:
        return args.model_bytes, "--model-bytes"
    if args.params is not None:
        return 4 * args.params, "--params (4 bytes each)"
    model = namespace.get("model")
    if isinstance(model, torch.nn.Module):
        n = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return n, "the trainable parameters of `model`"
    return None, ""


def advise(args: argparse.Namespace, group: dist.ProcessGroup, device: torch.device) -> dict:
    """Measure and recommend on every rank of ``group``; return the report as plain values (the same on every
    rank, since every figure is a maximum over ranks)."""
    world = dist.get_world_size(group)
    notes = []
    if args.step is None and args.script is None:
        step, model_bytes, source = synthetic_step(args.params or GPT_PARAMS, device)
        byte_source, synthetic = "the synthetic model", True
        notes.append("no --step or --script: the step timed is a SYNTHETIC stand-in, so the pick is for it, "
                     "not for your model")
    else:
        step, namespace, source = load_step(args.step, args.script)
        model_bytes, byte_source = _model_bytes(args, namespace)
        if model_bytes is None:
            raise ValueError(f"cannot tell the model's size from {source}: pass --params N or --model-bytes N, "
                             "or define `model` (an nn.Module) next to step()")
        synthetic = False
    if world < 2:
        raise ValueError("the advisor measures the link between nodes, so it needs a process on each of 2 or more "
                         "nodes (torchrun --nnodes=N --nproc_per_node=1); it was started as 1 process")
    per_rank = time_step(step, args.warmup, args.repeats, device)
    medians = [0.0] * world
    medians[dist.get_rank(group)] = statistics.median(per_rank)
    medians = max_over_ranks(medians, group, device)  # each rank fills its own slot: a gather by maximum
    probe, skipped = probe_allreduce(args.sizes, args.probe_repeats, args.max_probe_s, group, device)
    fit = fit_link([s for s, _ in probe], [t for _, t in probe])
    hosts = args.hosts or world
    if env.get_local_size() > 1:
        notes.append(f"{env.get_local_size()} processes share this node: the probe measured the path between them, "
                     "not the link between nodes; run one process per node (--nproc_per_node=1)")
    bus_bps = ring_allreduce_bytes(fit.bytes_per_s, world) * 8  # bits per second on each rank's link
    rec = recommend(max(medians), model_bytes, bus_bps, fit.latency_s, hosts)
    return {
        "world_size": world, "hosts": hosts, "backend": dist.get_backend(group), "device": str(device),
        "step": {"seconds": max(medians), "per_rank_s": medians, "warmup": args.warmup, "repeats": args.repeats,
                 "source": source, "synthetic": synthetic},
        "model": {"bytes": model_bytes, "source": byte_source},
        "link": {"probe": [{"bytes": s, "seconds": t} for s, t in probe], "skipped_bytes": skipped,
                 "latency_s": fit.latency_s, "allreduce_bytes_per_s": fit.bytes_per_s, "bandwidth_bps": bus_bps},
        "recommendation": rec.to_dict(), "notes": notes,
    }


def format_report(report: dict) -> str:
    """Return the human-readable report of :func:`advise`'s result."""
    step, link, rec = report["step"], report["link"], report["recommendation"]
    probe = ", ".join(f"{format_size(p['bytes'])} {p['seconds'] * 1e3:.3g} ms" for p in link["probe"])
    if link["skipped_bytes"]:
        probe += f" (skipped: {', '.join(format_size(s) for s in link['skipped_bytes'])}, too slow here)"
    lines = [
        f"bagua.advise: {report['hosts']} hosts ({report['world_size']} processes, {report['backend']}, "
        f"{report['device']})",
        f"step:     {step['seconds'] * 1e3:.4g} ms, median of {step['repeats']} after {step['warmup']} warm-up, "
        f"slowest rank ({step['source']})",
        f"model:    {report['model']['bytes'] / 1e6:.4g} MB of gradient per step ({report['model']['source']})",
        f"probe:    allreduce medians, slowest rank: {probe}",
        f"link:     fit {link['latency_s'] * 1e3:.3g} ms + bytes / {link['allreduce_bytes_per_s'] / 1e6:.4g} MB/s "
        f"per allreduce = latency {link['latency_s'] * 1e3:.3g} ms, bus bandwidth "
        f"{format_rate(link['bandwidth_bps'])} per host",
        f"pick:     {rec['pick']}: {rec['code']}",
        f"settings: {rec['settings']}",
        f"expected: {rec['vs_ddp']:g}x DDP's speed to the same target (the {rec['row']['link']} row of the "
        f"{rec['row']['hosts']}-host table; {rec['row']['evidence']})",
        "why:",
        *(f"  - {line}" for line in rec["reasoning"]),
    ]
    if report["notes"]:
        lines += ["notes:", *(f"  - {note}" for note in report["notes"])]
    return "\n".join(lines)


def _device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", env.get_local_rank())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the advisor under a launcher; rank 0 prints; return the exit status."""
    args = build_parser().parse_args(argv)
    device = _device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend=backend, init_method="env://")
    # our own group: nothing the advisor sends mixes with whatever else uses the default group
    group = dist.new_group(backend=backend)
    try:
        report = advise(args, group, device)
        if dist.get_rank(group) == 0:
            print(json.dumps(report, indent=1) if args.json else format_report(report), flush=True)
    except ValueError as exc:
        print(f"bagua.advise: {exc}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group(group)
        if created:
            dist.destroy_process_group()
    return 0
