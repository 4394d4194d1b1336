"""The Triton codec kernels against the memory traffic they must do and against the whole-tensor path (issue 51).

On one CUDA device, for ``--numel`` float32 (64 Mi by default):

- the device's copy bandwidth (``dst.copy_(src)``: bytes read plus written per second);
- per operation, the kernels' time (``BAGUA_FUSED_CODECS=1``) and the whole-tensor path's (``=0``), each the median
  of ``--repeats`` CUDA-event timings of ``--iters`` back-to-back calls;
- the block codes (uint8, uint4; encode, decode, decode-and-add) against the time their traffic takes at the copy's
  bandwidth (goal: within 1.5x); MinMaxUInt8 (per chunk) encode and decode as float32 GB/s over the copy's bytes/s
  (goal: at least 40 %, the unit of ``gpu_check``'s codec stage);
- whether the kernels' wire bytes and decoded values equal the CPU code's on the same data.

Run: ``python benchmarks/codecs/codec_fused.py [--numel N] [--json out.json]`` (``gpu_check``'s codec stage calls
:func:`bench_fused`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bagua.torch_api.codecs import block as bc  # noqa: E402
from bagua.torch_api.codecs import minmax_uint8 as mm  # noqa: E402

__all__ = ["BLOCK_GOAL", "MM_GOAL", "event_ms", "bench_fused", "main"]

BLOCK_GOAL = 1.5  # block codes: at most this times the traffic's time at the copy bandwidth
MM_GOAL = 0.40  # MinMaxUInt8: float32 bytes per second over the copy's bytes per second


def event_ms(fn, iters: int, repeats: int) -> float:
    """Median milliseconds of one ``fn()``: CUDA events around ``iters`` calls, ``repeats`` times, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def _both(fn, iters: int, repeats: int) -> dict:
    """``fn`` timed with the kernels and with the whole-tensor path."""
    out = {}
    for flag, name in (("1", "fused_ms"), ("0", "eager_ms")):
        os.environ["BAGUA_FUSED_CODECS"] = flag
        out[name] = round(event_ms(fn, iters, repeats), 4)
    os.environ["BAGUA_FUSED_CODECS"] = "1"
    return out


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def bench_fused(numel: int = 64 << 20, block: int = bc.DEFAULT_BLOCK, chunks: int = 8, iters: int = 20,
                repeats: int = 7) -> dict:
    """Time every operation and check its bytes; returns the copy bandwidth and one row per operation."""
    os.environ["BAGUA_FUSED_CODECS"] = "1"
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(51)
    x = torch.randn(numel, device=dev, generator=gen)
    copy_out = torch.empty_like(x)
    copy_ms = event_ms(lambda: copy_out.copy_(x), iters, repeats)
    copy_bps = 8 * numel / (copy_ms / 1e3)
    x_cpu = x.cpu()
    out = torch.empty_like(x)
    rows = []
    for codec in ("uint8", "uint4"):
        wire = bc.encode(x, codec, block)
        wire_bytes = wire.numel()
        same = torch.equal(wire.cpu(), bc.encode(x_cpu, codec, block))
        decoded_cpu = bc.decode(wire.cpu(), numel, codec, block)
        same_dec = _same_values(bc.decode(wire, numel, codec, block, out=out), decoded_cpu)
        cases = {
            "encode": (lambda: bc.encode(x, codec, block, out=wire), 4 * numel + wire_bytes, same),
            "decode": (lambda: bc.decode(wire, numel, codec, block, out=out), wire_bytes + 4 * numel, same_dec),
            "decode_add": (lambda: bc.decode(wire, numel, codec, block, out=out, accumulate=True),
                           wire_bytes + 8 * numel, None),
        }
        for op, (fn, traffic, identical) in cases.items():
            t = _both(fn, iters, repeats)
            bound_ms = traffic / copy_bps * 1e3
            rows.append({"codec": codec, "op": op, **t, "traffic_bytes": traffic, "traffic_ms": round(bound_ms, 4),
                         "of_traffic": round(t["fused_ms"] / bound_ms, 3), "goal": BLOCK_GOAL,
                         "met": t["fused_ms"] <= BLOCK_GOAL * bound_ms, "identical_to_cpu": identical})
    rows += _minmax_rows(x, x_cpu, chunks, copy_bps, iters, repeats)
    return {"device": torch.cuda.get_device_name(), "numel": numel, "block": block, "chunks": chunks,
            "copy_ms": round(copy_ms, 4), "copy_gb_per_s": round(copy_bps / 1e9, 1), "rows": rows}


def _minmax_rows(x: torch.Tensor, x_cpu: torch.Tensor, chunks: int, copy_bps: float, iters: int,
                 repeats: int) -> list[dict]:
    length = x.numel() // chunks
    xs, xs_cpu = x[: chunks * length].view(chunks, length), x_cpu[: chunks * length].view(chunks, length)
    wire = mm.wire_buffer(chunks, length, x.device)
    mm.encode_chunks(xs, wire)
    wire_cpu = mm.wire_buffer(chunks, length)
    mm.encode_chunks(xs_cpu, wire_cpu)
    out, out_cpu = torch.empty_like(xs), torch.empty_like(xs_cpu)
    mm.decode_chunks(wire, out)
    mm.decode_chunks(wire_cpu, out_cpu)
    total, total_cpu = torch.empty(length, device=x.device), torch.empty(length)
    mm.decode_sum_chunks(wire, total)
    mm.decode_sum_chunks(wire_cpu, total_cpu)
    cases = {
        "encode": (lambda: mm.encode_chunks(xs, wire), torch.equal(wire.cpu(), wire_cpu)),
        "decode": (lambda: mm.decode_chunks(wire, out), _same_values(out, out_cpu)),
        "decode_sum": (lambda: mm.decode_sum_chunks(wire, total), _same_values(total, total_cpu)),
    }
    rows = []
    for op, (fn, identical) in cases.items():
        t = _both(fn, iters, repeats)
        of_copy = 4 * chunks * length / (t["fused_ms"] / 1e3) / copy_bps
        rows.append({"codec": "minmax_uint8", "op": op, **t, "of_copy": round(of_copy, 4),
                     "eager_of_copy": round(4 * chunks * length / (t["eager_ms"] / 1e3) / copy_bps, 4),
                     "goal": MM_GOAL if op != "decode_sum" else None,
                     "met": of_copy >= MM_GOAL if op != "decode_sum" else None, "identical_to_cpu": identical})
    return rows


def describe(result: dict) -> list[str]:
    """One line per operation, for a log."""
    lines = [f"{result['device']}: copy of {result['numel']} float32 {result['copy_ms']:.3f} ms = "
             f"{result['copy_gb_per_s']:.0f} GB/s"]
    for r in result["rows"]:
        head = (f"{r['codec']} {r['op']}: fused {r['fused_ms']:.3f} ms, whole-tensor {r['eager_ms']:.3f} ms "
                f"({r['eager_ms'] / r['fused_ms']:.1f}x)")
        if "of_traffic" in r:
            goal = f"{r['of_traffic']:.2f}x the traffic's {r['traffic_ms']:.3f} ms (goal <= {r['goal']}x)"
        else:
            goal = f"{r['of_copy']:.0%} of the copy (whole-tensor {r['eager_of_copy']:.0%}; goal {r['goal']})"
        met = {True: "met", False: "MISSED", None: "-"}[r["met"]]
        lines.append(f"{head}; {goal}: {met}; identical to CPU: {r['identical_to_cpu']}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=64 << 20)
    p.add_argument("--block", type=int, default=bc.DEFAULT_BLOCK)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("codec_fused: needs CUDA")
        return 0
    result = bench_fused(args.numel, args.block, args.chunks, args.iters, args.repeats)
    print("\n".join(describe(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
