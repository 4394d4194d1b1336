"""MinMaxUInt8 with ``torch.compile`` (Triton on a GPU) against the eager codec: speed and bit-identity.

The eager CUDA codec (``bagua.torch_api.codecs.minmax_uint8``) makes about ten passes over memory per element (min, max,
multiply, round, subtract, clamp, cast, each a kernel). Written as one expression, ``torch.compile`` fuses the
encode into two kernels (a min/max reduction, then one read of the floats and one write of the codes) and the
decode into one. This script times both against the eager code on the same tensor and counts the codes and
values that differ from the eager codec's (the condition for using it: zero), on random data and on rows that
take the clamped path (huge ranges) or hold a NaN. It is the experiment of issue 31 (a fused kernel is allowed if
optional and bit-identical); ``benchmarks/gpu_check.sh``'s codec stage runs it on CUDA.

    python benchmarks/codec_compiled.py --numel 67108864 --chunks 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)  # benchmarks/codec.py, also when gpu_check loads this file by its path

from bagua.torch_api.codecs import minmax_uint8 as codec  # noqa: E402
from codec import timed_together  # noqa: E402 - the codec benchmark's round-robin timer


def _minmax(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((x.amin(dim=1), x.amax(dim=1)), dim=1)


def _encode_into(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, lower: torch.Tensor) -> None:
    # the eager formula (compression._encode_whole): round(x * scale) - lower, clamped to [0, 255], cast
    codes.copy_((torch.round(x * scale) - lower).clamp(0.0, 255.0))


def _decode_into(codes: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, lower: torch.Tensor) -> None:
    # the eager formula (compression.decode_chunks): (q + lower) / scale
    out.copy_((codes.float() + lower) / scale)


class Compiled:
    """The compiled encode and decode, on the same wire layout as :mod:`bagua.torch_api.codecs.minmax_uint8`."""

    def __init__(self) -> None:
        self.minmax = torch.compile(_minmax, dynamic=False)
        self.encode_into = torch.compile(_encode_into, dynamic=False)
        self.decode_into = torch.compile(_decode_into, dynamic=False)

    def encode(self, x: torch.Tensor, wire: torch.Tensor) -> None:
        params = codec.ChunkParams(self.minmax(x))
        wire[:, : codec.HEADER_BYTES].copy_(params.header)
        self.encode_into(x, wire[:, codec.HEADER_BYTES:], params.scale, params.lower)

    def decode(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        params = codec.ChunkParams.of_wire(wire)
        self.decode_into(wire[:, codec.HEADER_BYTES:], out, params.scale, params.lower)


def mismatches(compiled: Compiled, x: torch.Tensor) -> dict:
    """Codes and decoded values of ``compiled`` that differ from the eager codec's, for the rows of ``x``."""
    n, length = x.shape
    eager_wire, wire = codec.wire_buffer(n, length, x.device), codec.wire_buffer(n, length, x.device)
    codec.encode_chunks(x, eager_wire)
    compiled.encode(x, wire)
    eager_out, out = torch.empty_like(x), torch.empty_like(x)
    codec.decode_chunks(eager_wire, eager_out)
    compiled.decode(eager_wire, out)
    same = (out == eager_out) | (out.isnan() & eager_out.isnan())
    return {"codes": int((wire != eager_wire).sum()), "values": int((~same).sum())}


def bench_compiled(numel: int, chunks: int, device: torch.device, repeats: int) -> dict:
    """Median ms of the eager and the compiled encode and decode of ``numel`` float32 in ``chunks`` rows, and the
    mismatches on random rows and on special rows (huge range: the clamped path; a NaN)."""
    length = numel // chunks
    compiled = Compiled()
    torch.manual_seed(0)
    x = torch.randn(chunks, length, device=device)
    wire, eager_wire = codec.wire_buffer(chunks, length, device), codec.wire_buffer(chunks, length, device)
    work = codec.scratch_buffer(length * chunks, device)
    out = torch.empty_like(x)
    codec.encode_chunks(x, eager_wire, work)
    compiled.encode(x, wire)
    compiled.decode(eager_wire, out)
    seconds = timed_together({
        "eager_encode": lambda: codec.encode_chunks(x, eager_wire, work),
        "compiled_encode": lambda: compiled.encode(x, wire),
        "eager_decode": lambda: codec.decode_chunks(eager_wire, out),
        "compiled_decode": lambda: compiled.decode(eager_wire, out),
    }, repeats, device)
    special = torch.randn(3, 4099, device=device)
    special[0, 7] = 3e38
    special[0, 8] = -3e38
    special[1] *= 1e-30
    special[2, 5] = float("nan")
    return {"numel": chunks * length, "chunks": chunks, "ms": {k: round(v * 1e3, 4) for k, v in seconds.items()},
            "mismatch_random": mismatches(compiled, x), "mismatch_special": mismatches(compiled, special)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=64 << 20)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    result = bench_compiled(args.numel, args.chunks, torch.device(args.device), args.repeats)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
