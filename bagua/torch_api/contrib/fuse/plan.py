"""Which parameters of a segment are stepped together, and the state bookkeeping around that step.

A *run* is a range ``a..b`` of consecutive parameters of one
:class:`~bagua.torch_api.contrib.fuse.layout.Segment` that can be stepped as one tensor: each has its gradient in
the flat gradient buffer, the same state keys, and the same scalar state (the fused tensor has one ``step``). A run
is handed to the optimizer as *chunks*: 1-D views of the segment's flat buffers of at most ``chunk_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from bagua.torch_api.contrib.fuse.layout import Segment, scalar_to_param_device, state_buffer

__all__ = ["Run", "make_runs", "split_on_scalars", "make_run", "write_run", "elementwise_count", "cpu_chunk_bytes",
           "CPU_CHUNK_BUDGET"]

# On CPU a chunk is sized so that everything one chunk's step touches stays in the last-level cache between the
# step's passes: the parameter, its gradient, each elementwise state tensor and about as many temporaries as state
# tensors (Adam's sqrt and division results, Lion's interpolated momentum), within CPU_CHUNK_BUDGET bytes. On a
# 32 MiB-L3 EPYC this gives 1.5 MiB for SGD with momentum and for Lion and 1 MiB for Adam, at or next to the best
# sizes measured there (benchmarks/fused_optimizer.py --sweep-kib, docs/fused_optimizer.md): 1 MiB made SGD 6-11%
# slower than 1.5-4 MiB; 2 MiB made Lion 3-13% and 4 MiB Adam 7-30% slower than 1 MiB.
CPU_CHUNK_BUDGET = 6 << 20
CPU_CHUNK_MIN, CPU_CHUNK_MAX = 256 << 10, 4 << 20


def cpu_chunk_bytes(state_tensors: int) -> int:
    """Return the automatic CPU chunk size for a step with ``state_tensors`` elementwise state tensors.

    Example:
        >>> cpu_chunk_bytes(1) // 1024, cpu_chunk_bytes(2) // 1024, cpu_chunk_bytes(0) // 1024
        (1536, 1024, 3072)
    """
    size = CPU_CHUNK_BUDGET // (2 + 2 * state_tensors)
    return min(CPU_CHUNK_MAX, max(CPU_CHUNK_MIN, size - size % 4096))


@dataclass(eq=False)
class Run:
    """Parameters ``seg.params[a:b]`` stepped as the flat ``chunks`` (views of the segment's buffers).

    Fields: ``chunks`` and ``starts`` (each chunk's element offset in the segment), ``states`` (each chunk's
    optimizer state), ``slices`` (per chunk, the flat-state views handed to the optimizer, to tell whether it
    replaced them), ``checked`` (state keys whose per-parameter views are known to be in place), ``sized_for``
    (how many elementwise state tensors the automatic CPU chunk size assumed; None when not automatic).
    """

    seg: Segment
    a: int
    b: int
    chunks: list[torch.Tensor]
    starts: list[int]
    states: list[dict]
    slices: list[dict]
    checked: set = field(default_factory=set)
    sized_for: int | None = None


def make_runs(
    segments: list[Segment], codes: list[bytearray], loose: list[torch.Tensor], state: dict, chunk_bytes: Optional[int]
) -> tuple[list[Run], list[torch.Tensor]]:
    """Return the runs of one param group, and the parameters to step as themselves.

    Args:
        segments: the group's segments.
        codes: per segment, 1 where the parameter can be fused this step, 0 where not.
        loose: the group's parameters that are in no segment.
        state: the optimizer's ``state``.
        chunk_bytes: the most bytes per chunk; None: :func:`cpu_chunk_bytes` on CPU, unlimited elsewhere.
    """
    runs, loose = [], list(loose)
    for seg, seg_codes in zip(segments, codes):
        keys = [frozenset(state.get(p, ())) for p in seg.params]
        i, m = 0, len(seg.params)
        while i < m:
            if not seg_codes[i]:
                loose.append(seg.params[i])
                i += 1
                continue
            j = i + 1
            while j < m and seg_codes[j] and keys[j] == keys[i]:
                j += 1
            for a, b in split_on_scalars(seg, i, j, keys[i], state):
                runs.append(make_run(seg, a, b, state, chunk_bytes))
            i = j
    return runs, loose


def split_on_scalars(seg: Segment, i: int, j: int, keys, state: dict) -> list[tuple[int, int]]:
    """Cut ``i..j`` where scalar state (zero-dim tensors, Python values) differs between neighbours."""
    cuts = set()
    for key in keys:
        first = state[seg.params[i]][key]
        if isinstance(first, torch.Tensor):
            if first.dim() == 0:
                z = seg.scalar_state[key][i:j]
                cuts.update(i + 1 + int(t) for t in torch.nonzero(z[1:] != z[:-1]).flatten().tolist())
        else:
            for t in range(i + 1, j):
                if not _same(state[seg.params[t]][key], state[seg.params[t - 1]][key]):
                    cuts.add(t)
    bounds = [i, *sorted(cuts), j]
    return list(zip(bounds[:-1], bounds[1:]))


def make_run(seg: Segment, a: int, b: int, state: dict, chunk_bytes: Optional[int]) -> Run:
    """Cut ``seg.params[a:b]`` into chunks, each with its gradient and a state dict of flat views.

    Scalar state is cloned per chunk (every chunk advances its own copy identically); Python values are copied.
    """
    lo, hi = seg.offsets[a], seg.offsets[b]
    size = hi - lo
    first = state.get(seg.params[a]) or {}
    sized_for = None
    if chunk_bytes is None and seg.flat_param.device.type == "cpu":
        sized_for = elementwise_count(first)
        chunk_bytes = cpu_chunk_bytes(sized_for)
    if chunk_bytes is not None:
        size = max(1, chunk_bytes // seg.flat_param.element_size())
    chunks, states, slices = [], [], []
    starts = list(range(lo, hi, size))
    for s in starts:
        e = min(s + size, hi)
        chunk = torch.nn.Parameter(seg.flat_param[s:e], requires_grad=seg.params[a].requires_grad)
        chunk.grad = seg.flat_grad[s:e]
        st, sl = {}, {}
        for key, value in first.items():
            if not isinstance(value, torch.Tensor):
                st[key] = value
            elif value.dim() == 0:
                st[key] = value.clone()
            else:
                st[key] = sl[key] = seg.flat_state[key][s:e]
        chunks.append(chunk)
        states.append(st)
        slices.append(sl)
    return Run(seg, a, b, chunks, starts, states, slices, checked=set(first), sized_for=sized_for)


def elementwise_count(st: dict) -> int:
    """Return how many entries of the state dict ``st`` are elementwise (tensors of one or more dimensions)."""
    return sum(isinstance(v, torch.Tensor) and v.dim() > 0 for v in st.values())


def write_run(run: Run, fused_state: dict, state: dict) -> Optional[str]:
    """Keep per-parameter state as views of the flat state after the optimizer stepped ``run``.

    State the step created or replaced is copied into the flat buffers (made on first use) and each parameter's
    entry re-pointed at its view, once; scalar state is written to every parameter of the run.

    Returns:
        None, or why this optimizer cannot be fused (state that is not elementwise, or changed dtype or device).
        The caller re-plans when ``run.sized_for`` no longer matches the state (the first step made state).
    """
    seg = run.seg
    params = seg.params[run.a : run.b]
    for c, chunk in enumerate(run.chunks):
        run.states[c] = fused_state[chunk]
    for key, value in run.states[0].items():
        if not isinstance(value, torch.Tensor):
            for p in params:
                state[p][key] = value
        elif value.dim() == 0:
            flat = state_buffer(seg, key, value, scalar=True)
            if flat is None:  # a compiled step on a GPU moves ``step`` there (Dynamo's capturable step)
                flat = scalar_to_param_device(seg, key, value, state)
            if flat is None:
                return f"scalar state {key!r} changed dtype or device"
            flat[run.a : run.b].fill_(value)
            if key not in run.checked:
                for i in range(run.a, run.b):
                    state[seg.params[i]][key] = seg.scalar_views[key][i] = flat[i]
        elif value.shape == run.chunks[0].shape:
            flat = state_buffer(seg, key, value, scalar=False)
            if flat is None:
                return f"state {key!r} changed dtype or device"
            for c, (chunk, s) in enumerate(zip(run.chunks, run.starts)):
                got = run.states[c][key]
                if got is not run.slices[c].get(key):
                    view = flat[s : s + chunk.numel()]
                    with torch.no_grad():
                        view.copy_(got.reshape(-1))
                    run.states[c][key] = run.slices[c][key] = view
            if key not in run.checked:
                for i in range(run.a, run.b):
                    state[seg.params[i]][key] = seg.state_views[key][i] = seg.view(flat, i)
        else:
            return (
                f"the optimizer made state {key!r} of shape {tuple(value.shape)} for a flat tensor of shape "
                f"{tuple(run.chunks[0].shape)}: it is not elementwise, and this step's results differ from step()"
            )
        run.checked.add(key)
    return None


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not the same
        return a is b
