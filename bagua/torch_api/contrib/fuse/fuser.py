"""The fused-step state of one optimizer: its layout in flat storage, the checks of every step, the fused step.

Part of :mod:`bagua.torch_api.contrib.fuse.optimizer` (its docstring defines *run* and *chunk*; the layout's
docstring defines *segment*): :func:`~bagua.torch_api.contrib.fuse.optimizer.fuse_optimizer` sets a
:class:`_Fuser` on the optimizer and ``fuse_step`` calls its :meth:`_Fuser.step`.
"""

from __future__ import annotations

import logging
import operator
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Optional

import torch

from bagua.torch_api.bucket import in_bucket_storage
from bagua.torch_api.contrib.fuse.compiled import CompiledStep
from bagua.torch_api.contrib.fuse.layout import Segment, adopt, find_segments, fits_flat, flatten_params, install_grads
from bagua.torch_api.contrib.fuse.plan import Run, elementwise_count, make_runs, write_run

__all__: list[str] = []  # private to the fused optimizer: its public names are in optimizer.py

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _GroupLayout:
    """How one param group lies in flat storage."""

    params: list  # the group's ``params`` list object, as last seen
    ids: list[int]
    segments: list[Segment]
    loose: list[torch.Tensor]  # parameters in no segment: always stepped as themselves
    where: dict[int, tuple[Segment, int]]


class _Fuser:
    """The fused-step state of one optimizer (set on it as ``_bagua_fuser``)."""

    __slots__ = (
        # user settings
        "do_flatten", "check_flatten", "chunk_bytes",
        # internal state
        "optimizer", "layouts", "follow", "plan", "codes", "dirty", "in_step", "fallback", "warned", "handles",
        # the compiled step (None: eager), the plan stepped eagerly once (compiled from its next step on), and the
        # param groups and state built for that plan (kept, so that the compiled code's guards see the same objects)
        "compiled", "stepped_plan", "built",
        # stats
        "fused_count",
    )

    def __init__(
        self, optimizer, do_flatten: bool, check_flatten: bool, chunk_bytes: Optional[int], compiled: bool = False
    ):
        self.do_flatten, self.check_flatten, self.chunk_bytes = do_flatten, check_flatten, chunk_bytes
        self.optimizer = optimizer
        self.compiled = CompiledStep() if compiled else None
        self.stepped_plan, self.built = None, None
        # groups whose memory another owner took over (parameters moved into another flat buffer, or gradients in
        # Bagua's buckets): their segments are found in memory as it is (as with do_flatten=False), never copied back
        self.follow: set[int] = set()
        self.layouts = [self._build(g) for g in optimizer.param_groups]
        self.plan, self.codes = None, None
        self.in_step = self.fallback = False
        self.dirty = not do_flatten  # found segments need gradients: look for them at the first step
        self.warned: set = set()
        self.fused_count = 0
        self.handles = [
            optimizer.register_step_pre_hook(self._on_plain_step),
            optimizer.register_load_state_dict_post_hook(self._on_load),
        ]

    # --- one fused step, top-down -------------------------------------------------------------------------

    def step(self, closure):
        opt = self.optimizer
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.fallback:
            type(opt).step(opt)
            return loss
        self._sync_groups()
        if self.dirty:
            self._refresh()
        codes = self._check()
        if self.plan is None or codes != self.codes:
            self.plan, self.codes = self._make_plan(codes), codes
        compiled = self.compiled is not None and self.stepped_plan is self.plan
        fused_groups, fused_state = self._materialize(keep=compiled)
        saved = opt.param_groups, opt.state
        opt.param_groups, opt.state = fused_groups, fused_state
        self.in_step = True
        try:
            if compiled:
                states = [st for runs, _ in self.plan for run in runs for st in run.states]
                self.compiled.step(opt, saved[0], fused_groups, states)
            else:
                type(opt).step(opt)  # the class's step: its hooks run with this optimizer, not a copy
        except BaseException:
            self.plan, self.dirty = None, True
            raise
        finally:
            opt.param_groups, opt.state = saved
            self.in_step = False
        plan = self.stepped_plan = self.plan
        self._write_back(fused_groups, fused_state)
        if compiled and self.compiled.failed is not None:
            logger.warning("fuse_step: compiling the step failed (%s); the exact eager fused step runs from now on",
                           self.compiled.failed)
            self.compiled, self.plan = None, None  # the eager step's chunks are cut for the cache again
        # the original's count: one per param group in which this step fused at least two parameters
        self.fused_count += sum(any(run.b - run.a > 1 for run in runs) for runs, _ in plan)
        opt._bagua_fused_count = self.fused_count
        return loss

    # --- hooks ---------------------------------------------------------------------------------------------

    def _on_plain_step(self, optimizer, args, kwargs):
        if not self.in_step:
            self.dirty = True  # a plain step() may have created state outside the flat buffers

    def _on_load(self, optimizer):
        self.dirty = True

    def _warn(self, reason: str, message: str) -> None:
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(f"fuse_step: {message}", stacklevel=2)

    # --- layout --------------------------------------------------------------------------------------------

    def _build(self, group: dict, follow: bool = False) -> _GroupLayout:
        params, state = group["params"], self.optimizer.state
        segments = flatten_params(params, state) if self.do_flatten and not follow else find_segments(params, state)
        where = {id(p): (seg, i) for seg in segments for i, p in enumerate(seg.params)}
        loose = [p for p in params if id(p) not in where]
        return _GroupLayout(params, [id(p) for p in params], segments, loose, where)

    def _sync_groups(self) -> None:
        """Flatten param groups added (``add_param_group``) or changed since the last step."""
        groups = self.optimizer.param_groups
        del self.layouts[len(groups) :]
        self.follow = {gi for gi in self.follow if gi < len(groups)}
        for gi, group in enumerate(groups):
            lay = self.layouts[gi] if gi < len(self.layouts) else None
            params = group["params"]
            if lay is not None and params is lay.params and len(params) == len(lay.ids):
                continue
            if lay is not None and [id(p) for p in params] == lay.ids:
                lay.params = params  # same parameters in a new list, e.g. after load_state_dict
                continue
            if self.do_flatten and gi not in self.follow:
                what = "added" if lay is None else "changed"
                self._warn(f"group-{what}", f"param group {gi} was {what} after fuse_optimizer; flattening it now")
            new = self._build(group, gi in self.follow)
            self.layouts[gi:gi + 1] = [new]
            self.plan = None

    def _refresh(self) -> None:
        """Bring state created or replaced outside ``fuse_step`` back into the flat buffers."""
        self.dirty, self.plan = False, None
        state = self.optimizer.state
        for gi, lay in enumerate(self.layouts):
            if not self.do_flatten or gi in self.follow:
                self.layouts[gi] = self._build(self.optimizer.param_groups[gi], follow=True)
                continue
            moved = sum(adopt(seg, i, state.get(p)) for seg in lay.segments for i, p in enumerate(seg.params))
            if moved:
                self._warn(
                    "state", "optimizer state made outside fuse_step (a plain step(), load_state_dict()) was "
                    "copied into the flat state buffers",
                )

    def _check(self) -> list[list[bytearray]]:
        """Return, per group and segment, which parameters can be fused now (1) or not (0)."""
        codes = []
        for gi, lay in enumerate(self.layouts):
            group_codes = [self._check_segment(seg) for seg in lay.segments]
            if any(c is _FOREIGN for c in group_codes) and gi not in self.follow:
                self.follow.add(gi)
                self._warn(
                    "foreign", f"param group {gi}: parameters now live in another flat buffer, or gradients in Bagua's "
                    "buckets (with_bagua(do_flatten=True)); they are left "
                    "there and only what is contiguous in memory is fused. Pass do_flatten=False to with_bagua to "
                    "keep the fused layout",
                )
            if any(c is None or c is _FOREIGN for c in group_codes):  # broke, changed shape, or taken over
                self.layouts[gi] = lay = self._build(self.optimizer.param_groups[gi], gi in self.follow)
                group_codes = [self._check_segment(seg) for seg in lay.segments]
                self.plan = None
            codes.append(group_codes)
        return codes

    def _check_segment(self, seg: Segment) -> Any:
        """Return the segment's codes; None if it must be rebuilt; ``_FOREIGN`` if another owner took its memory."""
        # the common case in C-level loops: every gradient is its flat view and no parameter moved. These two
        # passes read two attributes of every parameter, most of whose objects the previous step evicted from the
        # caches: with thousands of parameters they cost about 0.4 us per parameter on CPU.
        params = seg.params
        moved = []
        if self.check_flatten and list(map(_DATA_PTR, params)) != seg.param_ptrs:
            moved = [i for i, p in enumerate(params) if p.data_ptr() != seg.param_ptrs[i]]
        if not moved and all(map(operator.is_, map(_GRAD, params), seg.grad_views)):
            return bytearray(seg.eligible)
        grads = list(map(_GRAD, params))
        codes = bytearray(seg.eligible)  # then 0 where the gradient is None or cannot join the flat gradient
        # after zero_grad() and a backward every gradient is a new tensor: told by two passes in C
        every_new = not any(map(operator.is_, grads, seg.grad_views)) and not any(map(operator.is_, grads, _NONES))
        if every_new:
            replaced = list(range(len(params)))
        else:
            replaced = [i for i, g, view in zip(range(len(params)), grads, seg.grad_views) if g is not view]
        # Memory that another owner flattened stays where it is, as in the original's fuse_step: parameters moved
        # into another buffer, or gradients in Bagua's buckets (with_bagua(do_flatten=True)). One gradient
        # decides: a segment's gradients come from one owner, and a mix is still stepped right by the copy path.
        # Other gradients that are views of a larger buffer (torch DDP's gradient_as_bucket_view, a user's
        # buffer) are copied in, as fresh ones are.
        first = next((grads[i] for i in replaced if grads[i] is not None), None)
        if seg.owned and (
            any(_in_other_buffer(params[i], seg.flat_param) for i in moved)
            or (first is not None and in_bucket_storage(first))
        ):
            return _FOREIGN
        if moved:
            if not seg.owned or not self._restore_params(seg, moved):
                return None
            self._warn("moved", "parameters left the flat buffer (.data reassigned?); copying them back")
        if replaced:
            fresh = replaced if every_new else [i for i in replaced if grads[i] is not None]
            if fresh and not seg.owned:
                return None
            fresh_grads = grads if every_new else [grads[i] for i in fresh]
            for i in install_grads(seg, fresh, fresh_grads) if fresh else ():
                codes[i] = 0
            for i in () if every_new else replaced:
                if grads[i] is None:
                    codes[i] = 0
        return codes

    @staticmethod
    def _restore_params(seg: Segment, moved: list[int]) -> bool:
        with torch.no_grad():
            for i in moved:
                p, view = seg.params[i], seg.view(seg.flat_param, i)
                if p.dtype != view.dtype or p.device != view.device or p.shape != view.shape or not fits_flat(p):
                    return False
                view.copy_(p)
                p.data = view
                seg.param_ptrs[i] = p.data_ptr()
        return True

    # --- plan: which parameters are stepped together ---------------------------------------------------------

    def _make_plan(self, codes) -> list[tuple[list[Run], list[torch.Tensor]]]:
        # compiled, a run is one tensor: the compiled loop makes one pass whatever its size, so there are no
        # passes to keep in cache
        chunk_bytes = sys.maxsize if self.compiled is not None and self.chunk_bytes is None else self.chunk_bytes
        return [
            make_runs(lay.segments, group_codes, lay.loose, self.optimizer.state, chunk_bytes)
            for lay, group_codes in zip(self.layouts, codes)
        ]

    def _materialize(self, keep: bool = False):
        """Build the param groups and state that the optimizer's own ``step`` will see.

        With ``keep`` (the compiled step) the ones built for this plan are reused, their hyper-parameters refreshed:
        the compiled code then meets the same objects at every step.
        """
        opt = self.optimizer
        if keep and self.built is not None and self.built[0] is self.plan:
            _, fused_groups, fused_state = self.built
            for group, fused in zip(opt.param_groups, fused_groups):
                fused.update((k, v) for k, v in group.items() if k != "params")
            return fused_groups, fused_state
        fused_state = _FusedState(opt.state)
        fused_groups = []
        for group, (runs, loose) in zip(opt.param_groups, self.plan):
            params = []
            for run in runs:
                params.extend(run.chunks)
                for chunk, st in zip(run.chunks, run.states):
                    fused_state[chunk] = st
            for p in loose:
                params.append(p)
                if p in opt.state:
                    fused_state[p] = opt.state[p]
            fused = dict(group)
            fused["params"] = params
            fused_groups.append(fused)
        self.built = (self.plan, fused_groups, fused_state) if keep else None
        return fused_groups, fused_state

    # --- write back ------------------------------------------------------------------------------------------

    def _write_back(self, fused_groups, fused_state) -> None:
        opt = self.optimizer
        for group, fused, lay, (runs, loose) in zip(opt.param_groups, fused_groups, self.layouts, self.plan):
            for key, value in fused.items():
                if key != "params" and group.get(key, _MISSING) is not value:
                    group[key] = value  # a hyper-parameter the step itself changed
            for run in runs:
                why = write_run(run, fused_state, opt.state)
                if why is not None:
                    return self._give_up(why)
                if run.sized_for is not None and run.sized_for != elementwise_count(run.states[0]):
                    self.plan = None  # the step made state: size the chunks for it at the next step
            for p in loose:
                st = fused_state.get(p)
                if st is not None and opt.state.get(p) is not st:
                    opt.state[p] = st
                if p.grad is not None and id(p) in lay.where:
                    seg, i = lay.where[id(p)]
                    was = seg.eligible[i]
                    if adopt(seg, i, opt.state.get(p)) or seg.eligible[i] != was:
                        self.codes = None  # its state is in the flat buffers now: it may join a run

    def _give_up(self, why: str) -> None:
        self.fallback = True
        self._warn("fallback", f"{why}; using the plain step() from now on")


class _FusedState(defaultdict):
    """The ``state`` the optimizer's step sees: the fused tensors' state, and for any other tensor the optimizer's own
    state, not a new empty dict. While the step runs, code that reads ``optimizer.state[p]`` for a real parameter
    (a step hook, QAdam's momentum getter on the communication thread) then finds ``p``'s state as it is."""

    def __init__(self, real: dict):
        super().__init__(dict)
        self.real = real

    def __missing__(self, key):
        if key in self.real:
            return self.real[key]
        return super().__missing__(key)


_MISSING = object()
_FOREIGN = object()
_GRAD = operator.attrgetter("grad")
_DATA_PTR = torch.Tensor.data_ptr
_NONES = repeat(None)  # endless: map() stops at the shorter iterable


def _in_other_buffer(t: torch.Tensor, own: torch.Tensor) -> bool:
    """Whether ``t`` is a piece of a larger buffer that is not ``own``: another owner's flat buffer, as opposed to
    a tensor of its own (``module.to()``). Used for moved parameters; gradients use ``in_bucket_storage``."""
    if t.layout != torch.strided:
        return False  # a sparse gradient has no storage to share; it is stepped as itself anyway
    storage = t.untyped_storage()
    return storage.nbytes() > t.numel() * t.element_size() and storage.data_ptr() != own.untyped_storage().data_ptr()
