"""What the advisor measures: the user's step, and allreduces of a few sizes between the hosts, fitted as a line.

The link is fitted as ``seconds = latency_s + bytes / bytes_per_s`` (Hockney's model) from the allreduce medians:
the bandwidth from the two largest sizes (their difference in bytes over their difference in seconds), the latency
from the smallest size (its seconds less its bytes at that bandwidth). Small messages are not on the line: a
shaper's burst bucket (tbf), a switch's buffers or an eager protocol make them cheaper than the bandwidth says (a
100 Mbit/s emulated link moved 64 KiB in 0.45 ms), so a least-squares line on relative residuals through every
size took its slope from them and overstated that link's bandwidth 200x.

Example:
    >>> fit = fit_link([4096, 2**20, 2**24], [1e-3 + 4096 / 1e8, 1e-3 + 2**20 / 1e8, 1e-3 + 2**24 / 1e8])
    >>> round(fit.latency_s * 1e3, 3), round(fit.bytes_per_s / 1e8, 3)
    (1.0, 1.0)
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["LinkFit", "fit_link", "parse_size", "format_size", "synthetic_step", "time_step", "probe_allreduce",
           "max_over_ranks"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30}


@dataclass(frozen=True)
class LinkFit:
    """A fitted link: ``seconds = latency_s + bytes / bytes_per_s`` for one allreduce of ``bytes``."""

    latency_s: float
    bytes_per_s: float


def parse_size(text: str) -> int:
    """Return ``text`` ("4KiB", "64MiB", "1000000") in bytes.

    Example:
        >>> parse_size("4KiB"), parse_size("64MiB"), parse_size("1000")
        (4096, 67108864, 1000)
    """
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]?i?b?)\s*", text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"cannot read the size {text!r}; write it as 4KiB, 1MiB, 64MiB or a number of bytes")
    size = int(match.group(1)) * _UNITS[match.group(2)]
    if size < 4:
        raise ValueError(f"size {text!r} is below one float32 (4 bytes)")
    return size


def format_size(n: float) -> str:
    """Return ``n`` bytes in KiB/MiB/GiB, at most three digits.

    Example:
        >>> format_size(4096), format_size(64 * 2**20)
        ('4 KiB', '64 MiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fit_link(sizes: Sequence[int], seconds: Sequence[float]) -> LinkFit:
    """Fit ``seconds = latency + bytes / bandwidth``: bandwidth from the two largest sizes, latency from the
    smallest (module docstring).

    With no growth between the two largest sizes (all latency, or noise), the bandwidth is the lower bound the
    largest size proves (``bytes / seconds``).
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"a fit needs at least two (size, seconds) pairs, got {len(sizes)} and {len(seconds)}")
    points = sorted(zip(sizes, seconds))
    (s1, t1), (s2, t2) = points[-2], points[-1]
    bytes_per_s = (s2 - s1) / (t2 - t1) if t2 > t1 and s2 > s1 else s2 / t2
    small, small_t = points[0]
    return LinkFit(latency_s=max(0.0, small_t - small / bytes_per_s), bytes_per_s=bytes_per_s)


def synthetic_step(params: int, device: torch.device, batch: int = 32) -> tuple[Callable[[], None], int, str]:
    """Return a stand-in step (an MLP of about ``params`` parameters: forward, backward, SGD), its gradient bytes
    and a description. Only a stand-in: the recommendation is for *this* step, not the user's model."""
    width = min(1024, max(8, int(params**0.5)))
    depth = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    n = sum(p.numel() for p in model.parameters())
    return step, 4 * n, f"SYNTHETIC step: an MLP of {n / 1e6:.3g} M parameters ({depth} x {width}), batch {batch}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[], object], warmup: int, repeats: int, device: torch.device) -> list[float]:
    """Return the seconds of ``repeats`` calls of ``step`` after ``warmup`` untimed ones (CUDA synchronised)."""
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def max_over_ranks(values: Sequence[float], group: dist.ProcessGroup, device: torch.device) -> list[float]:
    """Return the elementwise maximum of ``values`` over the ranks of ``group`` (the slowest rank sets the
    pace of a synchronous step)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def probe_allreduce(sizes: Sequence[int], repeats: int, max_s: float, group: dist.ProcessGroup,
                    device: torch.device) -> tuple[list[tuple[int, float]], list[int]]:
    """Time allreduces of each of ``sizes`` (ascending); return ([(bytes, median seconds of the slowest rank)],
    the sizes skipped).

    A size is skipped, with every larger one, when the last measured size predicts (linearly in bytes) that one
    allreduce of it takes over ``max_s``: a slow link would otherwise spend minutes on 64 MiB. The first two sizes
    are always measured (a line needs two points). Every rank reaches the same decision, since it is taken on the
    maxima over ranks.
    """
    sizes = sorted(sizes)
    measured: list[tuple[int, float]] = []
    for i, size in enumerate(sizes):
        if i >= 2 and measured[-1][1] * size / measured[-1][0] > max_s:
            return measured, sizes[i:]
        buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        dist.barrier(group=group)
        dist.all_reduce(buf, group=group)  # untimed: connections, buffers
        _sync(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(buf, group=group)
            _sync(device)
            times.append(time.perf_counter() - start)
        (slowest,) = max_over_ranks([statistics.median(times)], group, device)
        measured.append((size, slowest))
    return measured, []
