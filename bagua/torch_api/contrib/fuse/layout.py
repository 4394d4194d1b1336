"""Flat storage for an optimizer's parameters, gradients and per-parameter state.

Words used here and in :mod:`bagua.torch_api.contrib.fuse.optimizer` and :mod:`bagua.torch_api.contrib.fuse.fuser`:

- A *segment* is a list of parameters of one param group, of one dtype and one device, that lie back to back
  in flat buffers: ``flat_param`` holds the parameters, ``flat_grad`` the gradients and ``flat_state[key]``
  every *elementwise state* (a state tensor of the parameter's shape, such as Adam's ``exp_avg``), all at the
  same element offsets. *Scalar state* (a zero-dim state tensor such as ``step``) lives in
  ``scalar_state[key]``, one element per parameter. Per-parameter tensors are views of these buffers.
- An *owned* segment was flattened by us (``do_flatten=True``): when a tensor leaves it (a new gradient, state
  created by a plain ``step()``, a loaded state dict) its values are copied back in and it is re-pointed.
  A *found* segment (``do_flatten=False``) is memory that was already contiguous; when it breaks, it is found
  again from scratch.

Flat buffers are allocated by :func:`flat_buffer` (:mod:`bagua.torch_api.contrib.fuse.buffers`, on huge pages
where Linux allows) and gradients are copied in by :func:`install_grads` (:mod:`bagua.torch_api.contrib.fuse.grads`);
the :class:`Segment` record lives in :mod:`bagua.torch_api.contrib.fuse.segment`, below both; their names are
re-exported here.

Everything here is plain tensor bookkeeping; the decision of what to step together lives in ``fuser.py``.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

import torch

from bagua.torch_api.contrib.fuse.buffers import HUGE_PAGES_MIN_BYTES, flat_buffer, huge_pages_enabled
from bagua.torch_api.contrib.fuse.grads import copy_grads, copy_many, copy_ranges, install_grads
from bagua.torch_api.contrib.fuse.segment import Segment

__all__ = ["Segment", "fits_flat", "adjacent", "mutual_runs", "flatten_params", "find_segments", "adopt",
           "install_grads", "copy_ranges", "copy_grads", "copy_many", "state_buffer", "flat_buffer",
           "scalar_to_param_device",
           "huge_pages_enabled", "HUGE_PAGES_MIN_BYTES"]


def fits_flat(p: torch.Tensor) -> bool:
    """Return whether ``p`` can live in a flat buffer: dense, contiguous and at least one-dimensional.

    Zero-dim parameters are left alone because their elementwise state could not be told from scalar state.
    """
    return p.layout == torch.strided and p.dim() > 0 and p.is_contiguous()


def _grad_fits(p: torch.Tensor, g: Optional[torch.Tensor]) -> bool:
    return (
        g is not None
        and g.layout == torch.strided
        and g.dtype == p.dtype
        and g.device == p.device
        and g.shape == p.shape
    )


def adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Return whether contiguous ``b`` starts in memory right where contiguous ``a`` ends."""
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.is_contiguous()
        and b.is_contiguous()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.storage_offset() == a.storage_offset() + a.numel()
    )


def mutual_runs(columns: list[list[torch.Tensor]]) -> list[range]:
    """Split indices ``0..n-1`` into maximal ranges that are contiguous in memory in every column.

    Each column lists one tensor per parameter (the parameters, their gradients, one state key...). A range
    ``i..j`` is kept together when, for every column, tensor ``t + 1`` starts where tensor ``t`` ends.

    Example:
        >>> buf = torch.zeros(6)
        >>> mutual_runs([[buf[0:2], buf[2:4], torch.zeros(2)]])
        [range(0, 2), range(2, 3)]
    """
    n = len(columns[0]) if columns else 0
    runs, start = [], 0
    for t in range(1, n + 1):
        if t == n or not all(adjacent(col[t - 1], col[t]) for col in columns):
            runs.append(range(start, t))
            start = t
    return runs


def _empty_segment(params: list[torch.Tensor], owned: bool, flat_param: torch.Tensor, flat_grad: torch.Tensor):
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    m = len(params)
    return Segment(
        params=params,
        offsets=offsets,
        owned=owned,
        flat_param=flat_param,
        flat_grad=flat_grad,
        grad_views=[None] * m,
        param_ptrs=[p.data_ptr() for p in params] if not owned else [0] * m,
        installed=[False] * m,
        grad_ids=[0] * m,
        copy_ranges=copy_ranges(params, offsets, flat_grad),
        eligible=[True] * m,
    )


def _alias(first: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D tensor over ``numel`` elements of ``first``'s storage, starting where ``first`` starts."""
    out = torch.empty(0, dtype=first.dtype, device=first.device)
    return out.set_(first.untyped_storage(), first.storage_offset(), (numel,))


def flatten_params(params: list[torch.Tensor], state: dict) -> list[Segment]:
    """Copy ``params`` (one group) into new flat buffers, one segment per dtype and device, and re-point them.

    Parameters that do not fit a flat buffer (see :func:`fits_flat`) are left where they are. Gradients that
    exist are copied into the flat gradient and re-pointed; missing ones stay ``None``. Existing state is
    moved by :func:`adopt`.

    Returns:
        The owned segments, in the order their first parameter appears in ``params``.
    """
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if fits_flat(p):
            buckets.setdefault((p.dtype, p.device), []).append(p)
    segments = []
    for (dtype, device), ps in buckets.items():
        total = sum(p.numel() for p in ps)
        flat_param = flat_buffer(total, dtype, device, zero=False)
        flat_grad = flat_buffer(total, dtype, device)
        seg = _empty_segment(ps, True, flat_param, flat_grad)
        with torch.no_grad():
            for i, p in enumerate(ps):
                view = seg.view(flat_param, i)
                view.copy_(p)
                p.data = view
                seg.param_ptrs[i] = p.data_ptr()
                seg.grad_views[i] = seg.view(flat_grad, i)
                if p.grad is not None:
                    install_grads(seg, [i], repoint=True)
                adopt(seg, i, state.get(p))
        segments.append(seg)
    return segments


def state_buffer(seg: Segment, key: Hashable, value: torch.Tensor, scalar: bool) -> Optional[torch.Tensor]:
    """Return the flat buffer for state ``key`` (made on first use); None if ``value`` cannot share it.

    Args:
        seg: the segment.
        key: the state key, e.g. ``"exp_avg"``.
        value: a state tensor of one parameter (or of a fused tensor) for ``key``.
        scalar: True for zero-dim state (one element per parameter), False for elementwise state.

    Returns:
        ``seg.scalar_state[key]`` or ``seg.flat_state[key]``, or None when its dtype or device differs. A scalar
        of the buffer's dtype from another device is accepted (copied in) when the buffer is on the parameters'
        device: a CPU ``step`` from a checkpoint, after :func:`scalar_to_param_device` moved the buffer.
    """
    buffers, views = (seg.scalar_state, seg.scalar_views) if scalar else (seg.flat_state, seg.state_views)
    flat = buffers.get(key)
    if flat is None:
        numel = len(seg.params) if scalar else seg.offsets[-1]
        flat = buffers[key] = flat_buffer(numel, value.dtype, value.device)
        views[key] = [None] * len(seg.params)
    if flat.dtype != value.dtype:
        return None
    if flat.device != value.device and not (scalar and flat.device == seg.flat_param.device):
        return None
    return flat


def scalar_to_param_device(seg: Segment, key: Hashable, value: torch.Tensor, state: dict) -> Optional[torch.Tensor]:
    """Move the scalar state buffer ``key`` to the parameters' device when a step moved its value there.

    A step compiled by ``torch.compile`` keeps ``step`` on the parameters' GPU (Dynamo moves a CPU ``step`` there
    and traces the step as ``capturable``), where the eager first step made it on the CPU. The buffer follows with
    its values, and every parameter's entry in ``state`` is re-pointed at its element of the moved buffer.

    Returns:
        The moved buffer, or None when ``value`` differs in another way (dtype, or a device other than the
        parameters').
    """
    flat = seg.scalar_state.get(key)
    home = seg.flat_param.device
    if flat is None or value.dtype != flat.dtype or value.device == flat.device or value.device != home:
        return None
    moved = seg.scalar_state[key] = flat.to(value.device)
    views = seg.scalar_views[key]
    for i, view in enumerate(views):
        if view is None:
            continue
        views[i] = moved[i]
        st = state.get(seg.params[i])
        if st is not None and st.get(key) is view:
            st[key] = views[i]
    return moved


def adopt(seg: Segment, i: int, st: Optional[dict[Hashable, Any]]) -> int:
    """Move the state tensors of ``params[i]`` into the segment's flat state and re-point them.

    Elementwise state goes to ``flat_state``, zero-dim state to ``scalar_state``; values already there are not
    copied. Python values (ints, floats, ...) stay in the state dict. Any other tensor (another shape, or a
    dtype or device that differs from the other parameters' state) makes the parameter ineligible.

    Returns:
        How many state tensors were copied.
    """
    seg.eligible[i] = True
    moved = 0
    if not st:
        return moved
    p = seg.params[i]
    for key, value in st.items():
        if not isinstance(value, torch.Tensor):
            continue
        scalar = value.dim() == 0
        if not scalar and value.shape != p.shape:
            seg.eligible[i] = False
            continue
        views = seg.scalar_views if scalar else seg.state_views
        if key in views and views[key][i] is value:
            continue
        flat = state_buffer(seg, key, value, scalar)
        if flat is None:
            seg.eligible[i] = False
            continue
        view = flat[i] if scalar else seg.view(flat, i)
        with torch.no_grad():
            view.copy_(value)
        st[key] = view
        views[key][i] = view
        moved += 1
    return moved


def find_segments(params: list[torch.Tensor], state: dict) -> list[Segment]:
    """Find runs of ``params`` whose data, gradients and elementwise state are already contiguous.

    Used with ``do_flatten=False``: nothing is copied except scalar state (moved into ``scalar_state``). Only
    runs of at least two parameters become (found) segments.
    """
    cands = [p for p in params if fits_flat(p) and _grad_fits(p, p.grad)]
    cands.sort(key=lambda p: (str(p.dtype), str(p.device), p.untyped_storage().data_ptr(), p.storage_offset()))

    def keys(p):
        st = state.get(p) or {}
        return tuple(sorted((repr(k) for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0)))

    segments, start = [], 0
    for t in range(1, len(cands) + 1):
        if t < len(cands) and keys(cands[t]) == keys(cands[start]):
            continue
        chunk = cands[start:t]
        start = t
        if len(chunk) < 2:
            continue
        state_keys = [k for k, v in (state.get(chunk[0]) or {}).items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        columns = [chunk, [p.grad for p in chunk]] + [[state[p][k] for p in chunk] for k in state_keys]
        if any(state[p][k].shape != p.shape for k in state_keys for p in chunk):
            continue
        for run in mutual_runs(columns):
            if len(run) < 2:
                continue
            ps = chunk[run.start : run.stop]
            total = sum(p.numel() for p in ps)
            seg = _empty_segment(ps, False, _alias(ps[0], total), _alias(ps[0].grad, total))
            seg.grad_views = [p.grad for p in ps]
            seg.installed = [True] * len(ps)
            for k in state_keys:
                seg.flat_state[k] = _alias(state[ps[0]][k], total)
                seg.state_views[k] = [state[p][k] for p in ps]
            for i, p in enumerate(ps):
                adopt(seg, i, state.get(p))
            segments.append(seg)
    return segments
