"""Choosing a multistream group's stream count: online from training iterations, or by a timed allreduce.

Part of :mod:`bagua.torch_api.multistream`.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from bagua.torch_api.multistream.group import MultiStreamGroup

__all__ = ["DEFAULT_CALIBRATION_BYTES", "StreamChooser", "calibrate"]

#: Size :func:`calibrate` measures: about the engine's 10 MiB default bucket.
DEFAULT_CALIBRATION_BYTES = 16 << 20


class StreamChooser:
    """Choose the stream count from real training iterations; every rank ends with the same choice.

    Steps, driven by :meth:`on_iteration` (called once per iteration, at the same point on every rank):

    1. ``warmup`` iterations run as they are;
    2. each candidate (1, 2, 4, ... up to ``msg.max_streams``) runs ``probe`` iterations; the first after a
       switch is not timed, the others are (the time between consecutive calls);
    3. the ranks take the slowest rank's median per candidate (one ``all_reduce`` on a group of their own) and
       keep the fastest, unless it is less than ``margin`` faster than one stream; then the chooser is done.

    This is what makes ``enable(ddp)`` safe where the CPU, not the network, is the limit: extra streams that
    speed up a lone allreduce can still slow training by competing with backward for cores.

    Args:
        msg: the :class:`MultiStreamGroup` to set.
        warmup: iterations before the first probe.
        probe: iterations per candidate.
        margin: how much faster than one stream a candidate must be.
    """

    __slots__ = ("msg", "candidates", "warmup", "probe", "margin", "chosen", "_group", "_iter", "_t_last", "_times")

    def __init__(self, msg: MultiStreamGroup, warmup: int = 3, probe: int = 4, margin: float = 0.05) -> None:
        if warmup < 0 or probe < 2:
            raise ValueError(f"need warmup >= 0 and probe >= 2 iterations, got {warmup}, {probe}")
        # user settings
        self.msg = msg
        self.candidates = [k for k in (1, 2, 4, 8, 16) if k <= msg.max_streams]
        self.warmup = warmup
        self.probe = probe
        self.margin = margin
        # internal state
        self.chosen: Optional[int] = None if len(self.candidates) > 1 else 1
        self._group = dist.new_group(msg.ranks)  # collective, like the MultiStreamGroup itself
        self._iter = 0
        self._t_last: Optional[float] = None
        self._times: list[list[float]] = [[] for _ in self.candidates]

    def on_iteration(self) -> None:
        """Call once per training iteration, at the same point on every rank."""
        if self.chosen is not None:
            return
        now = time.perf_counter()
        previous = self._iter - 1 - self.warmup  # the iteration that just ended, counted from the first probe
        if previous >= 0 and previous // self.probe < len(self.candidates) and previous % self.probe > 0:
            assert self._t_last is not None
            self._times[previous // self.probe].append(now - self._t_last)
        self._t_last = now
        current = self._iter - self.warmup
        self._iter += 1
        if current < 0:
            return
        slot = current // self.probe
        if slot < len(self.candidates):
            self.msg.num_streams = self.candidates[slot]
            return
        medians = torch.tensor([sorted(t)[len(t) // 2] for t in self._times], dtype=torch.float64)
        if dist.get_backend(self._group) == "nccl":
            medians = medians.cuda()
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self._group)
        medians_list = medians.cpu().tolist()
        best = min(range(len(self.candidates)), key=lambda i: medians_list[i])
        self.chosen = self.candidates[best] if medians_list[best] < (1 - self.margin) * medians_list[0] else 1
        self.msg.num_streams = self.chosen


def calibrate(msg: MultiStreamGroup, nbytes: int = DEFAULT_CALIBRATION_BYTES, repeats: int = 3,
              margin: float = 0.1) -> int:
    """Measure the stream counts on this network and keep the fastest; collective over ``msg``'s ranks.

    Times an allreduce of ``nbytes`` with 1, 2, 4, ... streams (up to ``msg.max_streams``), ``repeats``
    rounds after one warm-up round, settings interleaved. Every rank takes the slowest rank's median, so all
    choose alike. More than one stream is kept only when it is at least ``margin`` faster than one: where one
    TCP stream already fills the link (or the CPU is the limit) the answer is 1, so enabling costs nothing.

    Returns:
        The chosen stream count (also set as ``msg.num_streams``).

    Example:
        >>> calibrate(MultiStreamGroup(max_streams=4))  # doctest: +SKIP
        4
    """
    if not msg.is_member() or len(msg.ranks) < 2:
        return msg.num_streams
    group = msg.groups[0]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else \
        torch.device("cpu")
    x = torch.zeros(max(nbytes // 4, 1), device=device)
    candidates = [k for k in (1, 2, 4, 8, 16) if k <= msg.max_streams]
    times = torch.zeros(len(candidates), repeats, dtype=torch.float64)
    for r in range(repeats + 1):
        for i, k in enumerate(candidates):
            msg.num_streams = k
            dist.barrier(group=group)
            t0 = time.perf_counter()
            msg.allreduce_(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r > 0:
                times[i, r - 1] = time.perf_counter() - t0
    medians = times.median(dim=1).values.to(device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    medians = medians.cpu().tolist()
    best = min(range(len(candidates)), key=lambda i: medians[i])
    chosen = candidates[best] if medians[best] < (1 - margin) * medians[0] else 1
    msg.num_streams = chosen
    msg.calls = msg.split_calls = 0
    return chosen
