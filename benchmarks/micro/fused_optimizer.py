"""Optimizer step time: fused (``fuse_optimizer`` + ``fuse_step``) vs unfused, torch foreach and torch fused.

For Adam(foreach=False), SGD with momentum and a user-written Lion (a per-parameter Python loop), it steps
``--params`` parameters of ``--shape`` with fixed gradients and times one ``step()`` per variant, round-robin
(variant A, B, C, D, A, B, ...), so that a noisy shared machine slows every variant alike; it prints the median
of ``--steps`` timings per variant and the ratios, and writes them as JSON with ``--out``.

Variants: ``unfused`` (``foreach=False``, the per-parameter loop), ``fused`` (the same optimizer after
``fuse_optimizer``, the exact eager step), ``compiled`` (``fuse_optimizer(..., compile=True)``: the step compiled by
``torch.compile``; its first two steps, eager and compiling, fall in the warm-up), ``foreach`` (torch
``foreach=True``) and ``torch_fused`` (torch ``fused=True``); the last two exist only for torch's Adam and SGD. ``unfused_new_grads`` and ``fused_new_grads`` are the unfused and fused steps
when every gradient is a new tensor, as after ``zero_grad()`` with its default ``set_to_none=True`` and a backward
(the tensors are made untimed before each step); the fused step then copies them into its flat gradient. The
``new grads`` column is their ratio, the speedup a user of the default ``zero_grad()`` sees; ``compiled_new_grads``
the same for the compiled step.

The memory limit: the bytes a step must move (read the parameters, gradients and every elementwise state tensor;
write back the parameters and the state) over this machine's copy bandwidth (``dst.copy_(src)`` of 64 MiB buffers,
read + written bytes over time on the benchmark's clock, measured before and after the timings, the faster kept). ``x limit`` columns are a
variant's step time over that bound. The load average is read at the start and at the end.

The fused variants use ``fuse_optimizer``'s defaults: on CPU, chunks sized for the optimizer's state and flat
buffers on transparent huge pages where Linux allows it (``--huge-pages off`` sets ``BAGUA_FUSE_HUGE_PAGES=0``;
``--chunk-bytes`` fixes the chunk size).

Usage:
    python benchmarks/micro/fused_optimizer.py                      # CPU, torch's default thread count
    python benchmarks/micro/fused_optimizer.py --threads 1 --clock cpu --steps 15 --out fused_1t.json
    python benchmarks/micro/fused_optimizer.py --device cuda --steps 50
    python benchmarks/micro/fused_optimizer.py --threads 1 --clock cpu --steps 24 --sweep-kib 1024 1536 2048 4096
    python benchmarks/micro/fused_optimizer.py --threads 1 --loop --steps 10 --optimizers adam lion

``--loop`` times a training loop instead, under the default ``zero_grad()``: backward and step timed apart for
the unfused and the fused optimizer in turns; the ratio ``step + extra bw`` charges the fused step with any time
its backward took beyond the unfused one's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from bagua.torch_api.contrib import fuse_optimizer
from bagua.torch_api.contrib.fuse.layout import huge_pages_enabled


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, arXiv 2302.06675) as users write it: a Python loop over parameters."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(m.mul(b1).add_(p.grad, alpha=1 - b1).sign_(), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


OPTIMIZERS = {
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, **kw),
    "sgd_momentum": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, **kw),
    "lion": lambda ps, **kw: Lion(ps, lr=1e-4, weight_decay=0.01),
}


def make_params(n, shape, device):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(shape, generator=gen).to(device)
    return params


def variants(name, n, shape, device, chunk_bytes, compiled):
    """Return ``{variant: step callable}`` for one optimizer; each variant owns its parameters."""
    make = OPTIMIZERS[name]
    out = {}
    plain = make(make_params(n, shape, device), foreach=False)
    out["unfused"] = plain.step
    fused = fuse_optimizer(make(make_params(n, shape, device), foreach=False), chunk_bytes=chunk_bytes)
    out["fused"] = fused.fuse_step
    # zero_grad() (set_to_none=True, the default) + backward: every step starts with new gradient tensors, made
    # (untimed) just before the step, as backward makes them
    out["unfused_new_grads"] = _with_new_grads(make(make_params(n, shape, device), foreach=False), "step")
    fresh = fuse_optimizer(make(make_params(n, shape, device), foreach=False), chunk_bytes=chunk_bytes)
    out["fused_new_grads"] = _with_new_grads(fresh, "fuse_step")
    if compiled:
        out["compiled"] = fuse_optimizer(make(make_params(n, shape, device), foreach=False), compile=True).fuse_step
        fresh = fuse_optimizer(make(make_params(n, shape, device), foreach=False), compile=True)
        out["compiled_new_grads"] = _with_new_grads(fresh, "fuse_step")
    if name != "lion":
        out["foreach"] = make(make_params(n, shape, device), foreach=True).step
        try:
            out["torch_fused"] = make(make_params(n, shape, device), fused=True).step
        except (RuntimeError, ValueError) as err:  # fused=True is not implemented for every device
            print(f"{name}: fused=True unavailable on {device}: {err}")
    return out


def _with_new_grads(opt, method):
    """Return ``(prepare, step)``: ``prepare`` gives every parameter a new gradient tensor (untimed)."""
    params = opt.param_groups[0]["params"]
    grads = [p.grad.clone() for p in params]

    def prepare():
        for p, g in zip(params, grads):
            p.grad = g.clone()

    return prepare, getattr(opt, method)


def copy_bandwidth(device, clock, nbytes=64 << 20, reps=9):
    """Bytes per second that ``dst.copy_(src)`` moves (read + written), median of ``reps`` copies, timed with the
    benchmark's clock (with ``--clock cpu`` a busy machine then slows the copy as little as it slows the steps)."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = []
    for _ in range(reps + 1):
        sync()
        t0 = now()
        dst.copy_(src)
        sync()
        times.append(now() - t0)
    return 2 * nbytes / statistics.median(times[1:])


def step_bytes(opt):
    """Bytes one step must move: parameters read and written, gradients read, each elementwise state tensor read and
    written (taken from the state of the optimizer's first parameter)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = opt.state.get(params[0], {})
    tensors = sum(isinstance(v, torch.Tensor) and v.dim() > 0 for v in state.values())
    return sum(p.numel() * p.element_size() for p in params) * (3 + 2 * tensors)


def sweep_variants(name, n, shape, device, kibs):
    """Return ``{variant: step callable}``: the unfused step and the fused step with each chunk size (KiB)."""
    make = OPTIMIZERS[name]
    out = {"unfused": make(make_params(n, shape, device), foreach=False).step}
    for kib in kibs:
        fused = fuse_optimizer(make(make_params(n, shape, device), foreach=False), chunk_bytes=kib << 10)
        out[f"fused@{kib}KiB"] = fused.fuse_step
    return out


def time_training_loop(name, n, shape, steps, warmup):
    """``--loop``: ``zero_grad()`` (default ``set_to_none=True``), a backward pass, and the step, timed apart, for the
    unfused and the fused optimizer in turns (CPU clock); return ``{variant: (backward ms, step ms)}`` medians.

    The loss is ``sum((p * c).sum())`` over the parameters, so backward makes one new gradient tensor per parameter
    and little else. ``fused_keep`` uses ``zero_grad(set_to_none=False)``: its gradients stay in the flat buffer.
    """
    make = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(1)
    consts = [torch.randn(shape, generator=gen) for _ in range(n)]
    runs = {
        "unfused": (make(make_params(n, shape, "cpu"), foreach=False), "step", True),
        "fused": (fuse_optimizer(make(make_params(n, shape, "cpu"), foreach=False)), "fuse_step", True),
        "fused_keep": (fuse_optimizer(make(make_params(n, shape, "cpu"), foreach=False)), "fuse_step", False),
    }
    times = {v: ([], []) for v in runs}
    for i in range(warmup + steps):
        for v, (opt, method, set_to_none) in runs.items():
            params = opt.param_groups[0]["params"]
            opt.zero_grad(set_to_none=set_to_none)
            loss = sum((p * c).sum() for p, c in zip(params, consts))
            t0 = time.process_time()
            loss.backward()
            t1 = time.process_time()
            getattr(opt, method)()
            t2 = time.process_time()
            if i >= warmup:
                times[v][0].append((t1 - t0) * 1e3)
                times[v][1].append((t2 - t1) * 1e3)
    return {v: (statistics.median(b), statistics.median(s)) for v, (b, s) in times.items()}


def print_training_loop(results):
    print("optimizer      " + "".join(f"{v + ' bw/step':>22}" for v in ("unfused", "fused", "fused_keep"))
          + f"{'step ratio':>12}{'(step + extra bw) ratio':>25}")
    for name, r in results.items():
        (bu, su), (bf, sf) = r["unfused"], r["fused"]
        cells = "".join(f"{b:>12.2f}/{s:<9.2f}" for b, s in (r[v] for v in ("unfused", "fused", "fused_keep")))
        print(f"{name:<15}{cells}{su / sf:>11.2f}x{su / (sf + bf - bu):>24.2f}x")


def time_round_robin(steps_by_variant, steps, warmup, device, clock):
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    now = time.process_time if clock == "cpu" else time.perf_counter
    times = {v: [] for v in steps_by_variant}
    for i in range(warmup + steps):
        for v, step in steps_by_variant.items():
            if isinstance(step, tuple):
                prepare, step = step
                prepare()
            sync()
            t0 = now()
            step()
            sync()
            if i >= warmup:
                times[v].append((now() - t0) * 1e3)
    return {v: statistics.median(ts) for v, ts in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=2000)
    parser.add_argument("--shape", type=int, nargs="+", default=[64, 64])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="fuse_optimizer chunk_bytes (default: auto)")
    parser.add_argument("--huge-pages", choices=["auto", "off"], default="auto",
                        help="off: BAGUA_FUSE_HUGE_PAGES=0, flat buffers on ordinary pages")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: perf_counter; cpu: this process's CPU time (steadier on a loaded machine; use "
                             "with --threads 1, as it adds up the threads' times)")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--sweep-kib", type=int, nargs="+", default=None,
                        help="instead: time the unfused step against fused steps with these chunk sizes (KiB)")
    parser.add_argument("--loop", action="store_true",
                        help="instead: zero_grad() + backward + step, backward and step timed apart (CPU clock)")
    parser.add_argument("--no-compiled", action="store_true", help="leave out the compiled variants")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.huge_pages == "off":
        os.environ["BAGUA_FUSE_HUGE_PAGES"] = "0"

    shape = tuple(args.shape)
    if args.loop:
        results = {name: time_training_loop(name, args.params, shape, args.steps, args.warmup)
                   for name in args.optimizers}
        print(f"\n{args.params} params of {shape}, cpu, {torch.get_num_threads()} threads, median of {args.steps} "
              "iterations, CPU clock (ms)")
        print_training_loop(results)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": dict(params=args.params, shape=list(shape), threads=torch.get_num_threads(),
                                        steps=args.steps, load_average=list(os.getloadavg()), loop=True),
                           "median_ms": {k: {v: dict(backward=b, step=s) for v, (b, s) in r.items()}
                                         for k, r in results.items()}}, f, indent=2)
        return
    if args.sweep_kib:
        for name in args.optimizers:
            r = time_round_robin(sweep_variants(name, args.params, shape, args.device, args.sweep_kib), args.steps,
                                 args.warmup, args.device, args.clock)
            print(f"{name:<14}" + "  ".join(f"{v} {ms:.2f} ms ({r['unfused'] / ms:.2f}x)" for v, ms in r.items()),
                  flush=True)
        return
    huge_pages = args.device == "cpu" and huge_pages_enabled()
    load = [os.getloadavg()[0]]
    bandwidth = copy_bandwidth(args.device, args.clock)
    results, chunks, limits = {}, {}, {}
    for name in args.optimizers:
        steps = variants(name, args.params, shape, args.device, args.chunk_bytes, not args.no_compiled)
        results[name] = time_round_robin(steps, args.steps, args.warmup, args.device, args.clock)
        fused = steps["fused"].__self__
        plan = fused._bagua_fuser.plan
        chunks[name] = sorted({c.numel() * c.element_size() for runs, _ in plan for run in runs for c in run.chunks})
        limits[name] = step_bytes(fused)
    bandwidth = max(bandwidth, copy_bandwidth(args.device, args.clock))
    load.append(os.getloadavg()[0])
    limit_ms = {name: b / bandwidth * 1e3 for name, b in limits.items()}

    print(f"\n{args.params} params of {shape}, {args.device}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, median of {args.steps} steps, {args.clock} clock (ms); "
          f"huge pages {'on' if huge_pages else 'off'}, fused chunk bytes {chunks}")
    cols = ["unfused", "fused", "unfused_new_grads", "fused_new_grads", "foreach", "torch_fused"]
    print(f"{'optimizer':<14}" + "".join(f"{c:>18}" for c in cols)
          + f"{'unfused/fused':>15}{'new grads':>11}{'foreach/fused':>15}{'fused/torch_fused':>19}")
    for name, r in results.items():
        ratio = lambda a, b: f"{r[a] / r[b]:.2f}x" if a in r and b in r else "-"  # noqa: E731
        print(f"{name:<14}" + "".join(f"{r[c]:>18.2f}" if c in r else f"{'-':>18}" for c in cols)
              + f"{ratio('unfused', 'fused'):>15}{ratio('unfused_new_grads', 'fused_new_grads'):>11}"
              + f"{ratio('foreach', 'fused'):>15}{ratio('fused', 'torch_fused'):>19}")
    if not args.no_compiled:
        print(f"\ncompiled (compile=True); memory limit: {bandwidth / 1e9:.1f} GB/s copy bandwidth")
        print(f"{'optimizer':<14}{'compiled':>10}{'new_grads':>11}{'limit':>8}{'unfused/':>10}{'new grads':>11}"
              f"{'/torch_fused':>14}{'fused x':>9}{'compiled x':>12}{'new grads x':>13}")
        print(f"{'':<14}{'':>10}{'':>11}{'':>8}{'compiled':>10}{'':>11}{'':>14}{'limit':>9}{'limit':>12}{'limit':>13}")
        for name, r in results.items():
            lim = limit_ms[name]
            ratio = lambda a, b: f"{r[a] / r[b]:.2f}x" if a in r and b in r else "-"  # noqa: E731
            print(f"{name:<14}{r['compiled']:>10.2f}{r['compiled_new_grads']:>11.2f}{lim:>8.2f}"
                  f"{ratio('unfused', 'compiled'):>10}{ratio('unfused_new_grads', 'compiled_new_grads'):>11}"
                  f"{ratio('compiled', 'torch_fused'):>14}{r['fused'] / lim:>8.2f}x{r['compiled'] / lim:>11.2f}x"
                  f"{r['compiled_new_grads'] / lim:>12.2f}x")
    print(f"load average (1 min): {load[0]:.2f} at the start, {load[1]:.2f} at the end")
    if args.out:
        meta = dict(params=args.params, shape=list(shape), device=args.device, threads=torch.get_num_threads(),
                    steps=args.steps, chunk_bytes=args.chunk_bytes, clock=args.clock, copy_bandwidth=bandwidth,
                    step_bytes=limits, limit_ms=limit_ms, load_average_start_end=load,
                    huge_pages=huge_pages, fused_chunk_bytes=chunks,
                    load_average=list(os.getloadavg()), torch=torch.__version__,
                    machine=platform.machine(), processor=platform.processor())
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "median_ms": results}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
