"""Codec throughput: GB/s of float32 input for encode, decode and the scatter-reduce's decode-sum.

For each size (1M and 25M floats by default) split into ``--chunks`` chunks (the ranks of a ByteGrad bucket),
times ``bagua.torch_api.codecs.minmax_uint8`` (MinMaxUInt8) against the same formula written as whole-tensor torch ops
(what a plain port does: one full-size temporary per step), on CPU with ``--threads`` intra-op threads and, when
CUDA is available, on the GPU. GB/s = 4 bytes x elements / median time.

A second table times the block-wise codecs of ``bagua.torch_api.codecs.block`` (bf16, uint8, uint4, nf2, and the
sparse topk) on the same sizes, for every ``--block-sizes``, round-robin with MinMaxUInt8 on the same tensor so that
both see the same load: ``vs mm`` is MinMaxUInt8's time over the codec's (encode against encode, decode against decode,
decode-and-add against decode-sum; above 1 is faster), then the wire bytes per element. Run:

    .venv/bin/python benchmarks/codecs/codec.py --out docs/log/results/codec.json

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bagua.torch_api.codecs import block as block_codec  # noqa: E402
from bagua.torch_api.codecs import minmax_uint8 as codec  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000000,25000000", help="comma-separated numbers of float32 elements")
    p.add_argument("--chunks", type=int, default=2, help="chunks per tensor (ranks of the communicator)")
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions (the median is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    p.add_argument("--devices", default="cpu,cuda", help="devices to try (cuda is skipped when unavailable)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="cpu: this thread's CPU time (steadier on a shared machine; needs --threads 1; CPU only)")
    p.add_argument("--block-sizes", default=str(block_codec.DEFAULT_BLOCK),
                   help="comma-separated block sizes for the block-wise codecs")
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


def timed_together(cases: dict, repeats: int, device: torch.device, clock: str = "wall") -> dict:
    """Median seconds of every case, timed round-robin (one run of each per round, after a warm-up round), so that
    the cases compared share the machine's load on a shared host."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    now = time.thread_time if clock == "cpu" and device.type == "cpu" else time.perf_counter
    times = {name: [] for name in cases}
    for rep in range(repeats + 1):
        for name, fn in cases.items():
            start = now()
            fn()
            sync()
            if rep:
                times[name].append(now() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_blocks(numel: int, block: int, chunks: int, device: torch.device, repeats: int,
                 clock: str = "wall") -> list[dict]:
    """The block-wise codecs on one flat tensor of ``numel`` elements (a rank's whole input), timed together with
    MinMaxUInt8 on the same tensor split into ``chunks`` chunks: ``vs_mm`` is MinMaxUInt8's time over the
    codec's for encode (against encode), decode (against decode) and decode-and-add (against decode-sum)."""
    length = numel // chunks
    x = torch.randn(chunks * length, device=device)
    out = torch.empty_like(x)
    mm_wire, mm_work = codec.wire_buffer(chunks, length, device), codec.scratch_buffer(length, device)
    mm_out, mm_own = torch.empty(chunks, length, device=device), torch.empty(length, device=device)
    codec.encode_chunks(x.view(chunks, length), mm_wire, mm_work)
    cases = {
        ("mm", "encode"): lambda: codec.encode_chunks(x.view(chunks, length), mm_wire, mm_work),
        ("mm", "decode"): lambda: codec.decode_chunks(mm_wire, mm_out),
        ("mm", "decode_add"): lambda: codec.decode_sum_chunks(mm_wire, mm_own, mm_work),
    }
    wires = {name: block_codec.encode(x, name, block) for name in block_codec.CODECS + block_codec.SPARSE}
    for name, wire in wires.items():
        cases[(name, "encode")] = lambda name=name, wire=wire: block_codec.encode(x, name, block, out=wire)
        cases[(name, "decode")] = lambda name=name, wire=wire: block_codec.decode(wire, x.numel(), name, block, out=out)
        cases[(name, "decode_add")] = lambda name=name, wire=wire: block_codec.decode(
            wire, x.numel(), name, block, out=out, accumulate=True)
    seconds = timed_together(cases, repeats, device, clock)
    return [
        {
            "device": device.type,
            "numel": x.numel(),
            "block": block,
            "codec": name,
            "op": op,
            "ms": round(t * 1e3, 3),
            "gb_per_s": round(4 * x.numel() / t / 1e9, 3),
            "vs_mm": round(seconds[("mm", op)] / t, 3),
            "wire_bytes_per_element": round(wires[name].numel() / x.numel(), 5),
        }
        for (name, op), t in seconds.items()
        if name != "mm"
    ]


def print_blocks(block_rows: list[dict]) -> None:
    """The block-wise table."""
    print(f"\n{'device':6} {'elements':>10} {'block':>6} {'codec':>5} {'op':>10} {'ms':>9} {'GB/s':>7} {'vs mm':>6} "
          f"{'bytes/el':>8}")
    for r in block_rows:
        print(f"{r['device']:6} {r['numel']:>10} {r['block']:>6} {r['codec']:>5} {r['op']:>10} {r['ms']:>9.2f} "
              f"{r['gb_per_s']:>7.2f} {r['vs_mm']:>6.2f} {r['wire_bytes_per_element']:>8.4f}")


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
    block_rows = []
    for device in devices:
        for numel in [int(s) for s in args.sizes.split(",")]:
            for block in [int(b) for b in args.block_sizes.split(",")]:
                block_rows += bench_blocks(numel, block, args.chunks, torch.device(device), args.repeats, args.clock)
    print_blocks(block_rows)
    malloc_env = {k: os.environ.get(k) for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")}
    result = {
        "torch": torch.__version__,
        "threads": args.threads,
        "clock": args.clock,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "malloc_env": malloc_env,
        "results": rows,
        "block_results": block_rows,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
