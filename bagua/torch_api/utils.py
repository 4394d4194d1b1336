"""Small tensor helpers with the original Bagua names: flattening, contiguity, dtypes, a time-weighted average.

Example:
    >>> ts = [torch.ones(2), torch.zeros(3)]
    >>> flat = flatten(ts)
    >>> [t.tolist() for t in unflatten(flat, ts)]
    [[1.0, 1.0], [0.0, 0.0, 0.0]]
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "flatten",
    "unflatten",
    "apply_flattened_call",
    "apply_flattened_call_all",
    "check_contiguous",
    "align_size",
    "to_bagua_datatype",
    "to_bagua_reduce_op",
    "StatisticalAverage",
]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``tensors`` (one dtype and device) into one new 1-D tensor.

    Args:
        tensors: dense tensors of one dtype and device.

    Returns:
        A fresh 1-D tensor holding every element of ``tensors`` in order.

    Example:
        >>> flatten([torch.ones(2, 2), torch.zeros(1)]).shape
        torch.Size([5])
    """
    if len(tensors) == 0:
        raise ValueError("flatten needs at least one tensor")
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split ``flat`` into views shaped like ``tensors`` (the inverse of :func:`flatten`).

    Args:
        flat: a 1-D tensor of ``sum(t.numel() for t in tensors)`` elements.
        tensors: the tensors whose shapes to take.

    Returns:
        Views of ``flat``, one per tensor, with that tensor's shape.

    Example:
        >>> [v.shape for v in unflatten(torch.arange(5.0), [torch.ones(2, 2), torch.ones(1)])]
        [torch.Size([2, 2]), torch.Size([1])]
    """
    total = sum(t.numel() for t in tensors)
    if flat.numel() != total:
        raise ValueError(f"flat tensor has {flat.numel()} elements, the tensors need {total}")
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def apply_flattened_call(
    bucket: Sequence[torch.Tensor], call: Callable[..., Any], extra_args: Optional[Sequence[Any]] = None
) -> None:
    """Run ``call`` once on the flattened ``bucket`` and copy the result back into each tensor.

    As in the original, when ``call`` is ``torch.distributed.all_reduce`` the sum is divided by the world size,
    so the bucket ends up averaged.

    Args:
        bucket: tensors of one dtype and device.
        call: a function taking the flat tensor (then ``*extra_args``) and changing it in place.
        extra_args: more positional arguments for ``call``.

    Example:
        >>> ts = [torch.ones(2), torch.ones(3)]
        >>> apply_flattened_call(ts, lambda t: t.mul_(2))
        >>> ts[1].tolist()
        [2.0, 2.0, 2.0]
    """
    coalesced = flatten(bucket)
    call(coalesced, *(extra_args or ()))
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for buf, synced in zip(bucket, unflatten(coalesced, bucket)):
        buf.copy_(synced)


def apply_flattened_call_all(tensors: Sequence[torch.Tensor], call: Callable[..., Any]) -> None:
    """Apply :func:`apply_flattened_call` to ``tensors`` grouped by type (dtype and device), in first-seen order."""
    groups: dict[str, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(f"{t.type()}@{t.device}", []).append(t)
    for group in groups.values():
        apply_flattened_call(group, call)


def align_size(size: int, align: int) -> int:
    """Round ``size`` up to a multiple of ``align``."""
    return (size + align - 1) // align * align


def check_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether each tensor starts in memory exactly where the previous one ends (one flat buffer, in order).

    Example:
        >>> flat = torch.zeros(6)
        >>> check_contiguous([flat[:2], flat[2:6]]), check_contiguous([flat[2:6], flat[:2]])
        (True, False)
    """
    end = None
    for t in tensors:
        if end is not None and t.data_ptr() != end:
            return False
        end = t.data_ptr() + t.numel() * t.element_size()
    return True


_BAGUA_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.uint8: "u8", torch.int64: "i64"}


def to_bagua_datatype(datatype: torch.dtype) -> str:
    """The original's dtype name (``"f32"``, ``"f16"``, ``"u8"``, ``"i64"``) of a torch dtype.

    Raises:
        ValueError: for any other dtype.
    """
    try:
        return _BAGUA_DTYPES[datatype]
    except KeyError:
        raise ValueError(f"unsupported data type {datatype}; supported: {list(_BAGUA_DTYPES)}") from None


def to_bagua_reduce_op(torch_reduce_op: Any) -> int:
    """The original's integer reduce op (see :class:`~bagua.torch_api.communication.ReduceOp`) of a torch one."""
    from bagua.torch_api.communication import ReduceOp  # communication imports nothing from here

    for name in ("SUM", "PRODUCT", "MIN", "MAX", "BOR", "BAND", "BXOR"):
        if torch_reduce_op == getattr(dist.ReduceOp, name):
            return int(ReduceOp[name])
    raise ValueError(f"unsupported reduce op {torch_reduce_op}")


class StatisticalAverage:
    """Time-weighted average of a recorded value over the last ``n`` seconds, for any ``n``, in O(log T) memory.

    A value given to :meth:`record` is taken to have held since the previous record. The state is
    ``records[i]``: the average over the ``2**i`` seconds before ``last_update_time``, and ``record_tail``
    ``(length, mean)``: the average over the whole recorded span, which is ``2**(len(records) - 1) + length``
    seconds. Averages between those windows are interpolated linearly in the window length.

    Args:
        last_update_time: time of the latest record (seconds since the epoch); default now.
        records: averages over windows of 1, 2, 4... seconds ending at ``last_update_time``.
        record_tail: ``(length in seconds beyond the last window, average over the whole span)``.

    Example:
        >>> m = StatisticalAverage()
        >>> m.record(3.0)  # doctest: +SKIP
        >>> m.get(10.0)  # doctest: +SKIP
        3.0
    """

    def __init__(
        self,
        last_update_time: Optional[float] = None,
        records: Optional[list[float]] = None,
        record_tail: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.last_update_time: float = time.time() if last_update_time is None else float(last_update_time)
        self.records: list[float] = list(records or [])
        self.record_tail: tuple[float, float] = (float(record_tail[0]), float(record_tail[1]))

    def record_seconds(self) -> float:
        """Length of the longest window in ``records`` (0 when empty)."""
        return 2.0 ** (len(self.records) - 1) if self.records else 0.0

    def total_recording_time(self) -> float:
        """Seconds covered by the recorded history."""
        return self.record_seconds() + self.record_tail[0]

    def get_records_mean(self, last_n_seconds: float) -> float:
        """Average over the ``last_n_seconds`` before ``last_update_time`` (the whole history's if longer)."""
        if last_n_seconds <= 0:
            return 0.0
        tail_len, tail_mean = self.record_tail
        if not self.records:
            return tail_mean
        span = self.record_seconds()
        if last_n_seconds <= span:
            i = max(0, int(math.floor(math.log2(last_n_seconds))))
            if i + 1 >= len(self.records):
                return self.records[-1]
            lo = 2.0 ** i
            return _lerp(self.records[i], self.records[i + 1], (last_n_seconds - lo) / lo)
        if last_n_seconds <= span + tail_len:
            return _lerp(self.records[-1], tail_mean, (last_n_seconds - span) / tail_len)
        return tail_mean if tail_len > 0 else self.records[-1]

    def record(self, val: float) -> None:
        """Record ``val`` as the value since the previous record.

        Each window of ``2**i`` seconds ending now mixes ``val`` over the time since the last record and the old
        history over the rest; once a window reaches back past the history, the tail holds the whole span.
        """
        now = time.time()
        elapsed = max(now - self.last_update_time, 0.0)
        history = self.total_recording_time()
        total = elapsed + history
        records: list[float] = []
        tail = (0.0, 0.0)
        i = 0
        while total > 0:
            window = 2.0 ** i
            if window > total:
                tail_len = total - 2.0 ** (len(records) - 1) if records else total
                share = elapsed / total
                tail = (tail_len, val * share + self.get_records_mean(history) * (1.0 - share))
                break
            share = min(1.0, elapsed / window)
            records.append(val * share + self.get_records_mean(window - elapsed) * (1.0 - share)
                           if share < 1.0 else val)
            i += 1
        self.last_update_time = now
        self.records = records
        self.record_tail = tail

    def get(self, last_n_seconds: float) -> float:
        """Average over the ``last_n_seconds`` before now (the latest record counts up to now)."""
        since = time.time() - self.last_update_time
        if last_n_seconds <= since:
            return self.records[0] if self.records else self.record_tail[1]
        return self.get_records_mean(last_n_seconds - since)

    def __str__(self) -> str:
        return str({"last_update_time": self.last_update_time, "records": self.records,
                    "record_tail": self.record_tail})

    __repr__ = __str__


def _lerp(a: float, b: float, frac: float) -> float:
    return a + (b - a) * frac
