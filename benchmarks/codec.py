"""MinMaxUInt8 codec throughput: GB/s of float32 input for encode, decode and the scatter-reduce's decode-sum.

For each size (1M and 25M floats by default) split into ``--chunks`` chunks (the ranks of a ByteGrad bucket),
times ``bagua.torch_api.compression`` against the same formula written as whole-tensor torch ops (what a plain
port does: one full-size temporary per step), on CPU with ``--threads`` intra-op threads and, when CUDA is
available, on the GPU. GB/s = 4 bytes x elements / median time. Run:

    .venv/bin/python benchmarks/codec.py --out docs/results/codec.json

Allocations dominate the plain formula on Linux unless the allocator keeps freed memory (the launcher's
``MALLOC_*`` settings, ``bagua.torch_api.env.ALLOCATOR_ENV``); set them for a fair comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bagua.torch_api import compression as codec  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000000,25000000", help="comma-separated numbers of float32 elements")
    p.add_argument("--chunks", type=int, default=2, help="chunks per tensor (ranks of the communicator)")
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions (the median is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    p.add_argument("--devices", default="cpu,cuda", help="devices to try (cuda is skipped when unavailable)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="cpu: this thread's CPU time (steadier on a shared machine; needs --threads 1; CPU only)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


# -- the formula as whole-tensor ops, for comparison -----------------------------------------------------------


def plain_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mn, mx = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    scale = 255.0 / (mx - mn + 1e-7)
    upper = torch.round(mx * scale)
    lower = upper - 255.0
    q = (torch.minimum(torch.round(x * scale), upper) - lower).to(torch.uint8)
    return q, torch.cat([mn, mx], dim=1)


def plain_decode(q: torch.Tensor, minmax: torch.Tensor) -> torch.Tensor:
    mn, mx = minmax[:, 0:1], minmax[:, 1:2]
    scale = 255.0 / (mx - mn + 1e-7)
    lower = torch.round(mx * scale) - 255.0
    return (q.float() + lower) / scale


# -- timing ----------------------------------------------------------------------------------------------------


def timed(fn, repeats: int, device: torch.device, clock: str = "wall") -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    now = time.thread_time if clock == "cpu" and device.type == "cpu" else time.perf_counter
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = now()
        fn()
        sync()
        times.append(now() - start)
    return statistics.median(times)


def bench(numel: int, chunks: int, device: torch.device, repeats: int, clock: str = "wall") -> list[dict]:
    length = numel // chunks
    x = torch.randn(chunks, length, device=device)
    wire = codec.wire_buffer(chunks, length, device)
    work = codec.scratch_buffer(length, device)
    out = torch.empty_like(x)
    own = torch.empty(length, device=device)
    codec.encode_chunks(x, wire, work)
    q, minmax = plain_encode(x)
    cases = {
        "encode": lambda: codec.encode_chunks(x, wire, work),
        "decode": lambda: codec.decode_chunks(wire, out),
        "decode_sum": lambda: codec.decode_sum_chunks(wire, own, work),
        "plain_encode": lambda: plain_encode(x),
        "plain_decode": lambda: plain_decode(q, minmax),
    }
    rows = []
    for op, fn in cases.items():
        seconds = timed(fn, repeats, device, clock)
        rows.append(
            {
                "device": device.type,
                "numel": chunks * length,
                "chunks": chunks,
                "op": op,
                "ms": round(seconds * 1e3, 3),
                "gb_per_s": round(4 * chunks * length / seconds / 1e9, 3),
            }
        )
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu measures this thread only: use it with --threads 1")
    torch.set_num_threads(args.threads)
    devices = [d for d in args.devices.split(",") if d == "cpu" or (d == "cuda" and torch.cuda.is_available())]
    rows = []
    print(f"{'device':6} {'elements':>10} {'op':>12} {'ms':>9} {'GB/s':>7}")
    for device in devices:
        for numel in [int(s) for s in args.sizes.split(",")]:
            for row in bench(numel, args.chunks, torch.device(device), args.repeats, args.clock):
                rows.append(row)
                print(f"{row['device']:6} {row['numel']:>10} {row['op']:>12} {row['ms']:>9.2f} {row['gb_per_s']:>7.2f}")
    malloc_env = {k: os.environ.get(k) for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")}
    result = {
        "torch": torch.__version__,
        "threads": args.threads,
        "clock": args.clock,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "malloc_env": malloc_env,
        "results": rows,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
