"""What the workload measures besides its timed steps: one training step, the compute phase of an unwrapped
replica, the compression cost per step (:data:`CODEC_PASSES`) and the digits models' accuracy.

Part of :mod:`benchmarks.common.workload`, which re-exports :data:`CODEC_PASSES`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import torch

from benchmarks.cost.cost_equations import HALF_HOOKS
from benchmarks.common.systems import _build_optimizer

__all__ = ["CODEC_PASSES"]

#: Compression work per step, in passes over the gradient: ``(encodes, decodes)`` of MinMaxUInt8 as a function
#: of the world size ``n`` (ByteGrad/QAdam: encode all, decode all n received chunks, encode the reduced chunk,
#: decode the gathered result), or a cast round trip for fp16.
CODEC_PASSES: dict[str, Callable[[int], tuple[float, float]]] = {
    "bytegrad": lambda n: (1 + 1 / n, 2.0),
    "qadam": lambda n: (1 + 1 / n, 2.0),
    "low_precision_decentralized": lambda n: (1.0, 2.0),
    "ddp_fp16": lambda n: (1.0, 1.0),
    "ddp_bf16": lambda n: (1.0, 1.0),
}

def _step(model: torch.nn.Module, optimizer: Any, loss_fn: Callable, x, y) -> float:
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _median_compute_step(replica: torch.nn.Module, optimizer_kind: str, lr: float, loss_fn: Callable,
                         batches: list, n: int) -> float:
    optimizer = _build_optimizer(optimizer_kind, replica, lr)
    times = []
    for i in range(n + 1):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        _step(replica, optimizer, loss_fn, x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _codec_seconds(system: str, numel: int, world: int, repeats: int = 2) -> Optional[float]:
    """Estimated compression seconds per step for ``system`` (see :data:`CODEC_PASSES`)."""
    if system not in CODEC_PASSES:
        return 0.0 if system in ("ddp", "gradient_allreduce", "decentralized", "async") else None
    encodes, decodes = CODEC_PASSES[system](world)
    x = torch.randn(numel)
    if system in HALF_HOOKS:
        dtype = torch.float16 if system == "ddp_fp16" else torch.bfloat16
        enc = _best_of(lambda: x.to(dtype), repeats)
        on_wire = x.to(dtype)
        dec = _best_of(lambda: on_wire.float(), repeats)
    else:
        from bagua.torch_api.codecs import minmax_uint8 as compression
        rows = max(world, 1)
        length = -(-numel // rows)
        xs = torch.zeros(rows * length)
        xs[:numel] = x
        xs = xs.view(rows, length)
        wire = compression.wire_buffer(rows, length)
        out = torch.empty_like(xs)
        enc = _best_of(lambda: compression.encode_chunks(xs, wire), repeats)
        dec = _best_of(lambda: compression.decode_chunks(wire, out), repeats)
    return encodes * enc + decodes * dec


def _best_of(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _evaluate(model: torch.nn.Module, test: tuple) -> float:
    x_te, y_te = test
    was_training = model.training
    model.eval()
    with torch.no_grad():
        acc = float((model(x_te).argmax(dim=1) == y_te).float().mean())
    model.train(was_training)
    return acc
