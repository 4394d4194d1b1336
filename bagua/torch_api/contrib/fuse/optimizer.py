"""Fused optimizer: run any elementwise optimizer's own ``step`` on a few large flat tensors.

An elementwise optimizer (SGD, Adam, AdamW, RMSprop, Rprop, Adagrad, Adamax, Adadelta, NAdam, RAdam, ASGD, a
user's Lion written as a per-parameter Python loop...) computes the same numbers on a concatenation of tensors
as on the pieces. :func:`fuse_optimizer` therefore keeps each param group's parameters, gradients and state
tensors as views of flat buffers (one :class:`~bagua.torch_api.contrib.fuse.layout.Segment` per dtype and
device), and :func:`fuse_step` runs the optimizer's unmodified ``step`` over a param group that holds one flat
parameter per *run* of parameters that can be stepped together, cut into *chunks* of about ``chunk_bytes``
(on CPU a chunk that fits in cache keeps a multi-pass step like Adam's in cache). Results are bitwise equal to
``step()`` for float32/float64 parameters; only the number of tensors, and so the Python and kernel-launch
overhead, shrinks. (bf16/fp16 parameters on CPU can differ by one rounding at the few elements where PyTorch's
kernels switch from vector to scalar code, as the unfused step does between thread counts; see the docs.)

A run is a range of consecutive parameters of a segment that have a gradient in the flat gradient buffer, the
same state keys, and equal scalar state (``step``, NAdam's ``mu_product``...). A parameter outside every run
(no gradient, a sparse gradient, state of another shape) is stepped as itself in the same ``step`` call.

Limits: optimizers that reduce per tensor (LAMB, LARS, Adafactor, Muon, anything computing a norm per parameter)
are not elementwise and give different results; ``LBFGS``, ``SparseAdam``, ``Adafactor`` and ``Muon`` are refused.
"""

from __future__ import annotations

import operator
import types
import warnings
from collections import defaultdict
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Callable, Optional

import torch

from bagua.torch_api.bucket import in_bucket_storage
from bagua.torch_api.contrib.fuse.layout import Segment, adopt, find_segments, fits_flat, flatten_params, install_grads
from bagua.torch_api.contrib.fuse.plan import Run, elementwise_count, make_runs, write_run

__all__ = ["fuse_optimizer", "is_fused_optimizer", "fuse_step"]

_ATTR = "_bagua_fuser"
_NOT_ELEMENTWISE = tuple(
    getattr(torch.optim, name) for name in ("LBFGS", "SparseAdam", "Adafactor", "Muon") if hasattr(torch.optim, name)
)


def fuse_optimizer(
    optimizer: torch.optim.Optimizer,
    do_flatten: bool = True,
    check_flatten: bool = True,
    *,
    replace_step: bool = False,
    chunk_bytes: Optional[int] = None,
) -> torch.optim.Optimizer:
    """Make ``optimizer`` fusable: give it a ``fuse_step`` method that steps a few flat tensors.

    The optimizer object is returned, not a copy; ``optimizer.step()`` keeps its unfused behaviour unless
    ``replace_step=True``. No class is patched: ``fuse_step`` is set on this instance only.

    Args:
        optimizer: any :class:`torch.optim.Optimizer` whose update is elementwise.
        do_flatten: copy each param group's parameters, gradients and state tensors into flat buffers now (per
            dtype and device) and point them there. With False nothing is moved: only memory that is already
            contiguous in parameters, gradients and states is fused.
        check_flatten: check at every ``fuse_step`` that the parameters still live in the flat buffers (a
            ``module.to()`` or ``param.data = ...`` moves them) and copy them back with a warning. Gradients are
            always checked; state replaced by a plain ``step()`` or ``load_state_dict()`` is always caught.
        replace_step: also route ``optimizer.step`` to the fused step, so code that calls ``step()`` itself
            (``torch.amp.GradScaler.step``, Lightning, LR-scheduler wrappers made afterwards) runs it fused.
        chunk_bytes: the most bytes one fused tensor spans. None: on CPU, sized so that what one chunk's step
            touches stays in cache between its passes (:func:`~bagua.torch_api.contrib.fuse.plan.cpu_chunk_bytes`:
            1.5 MiB for SGD with momentum, 1 MiB for Adam); unlimited on other devices.

    Returns:
        The same ``optimizer``, with ``fuse_step(closure=None)`` and ``_bagua_fused_count``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = fuse_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.fuse_step()
        >>> opt.zero_grad(set_to_none=False)  # keeps gradients in the flat buffer
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fuse_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if is_fused_optimizer(optimizer):
        raise RuntimeError("this optimizer is already fused; call fuse_optimizer once per optimizer")
    if isinstance(optimizer, _NOT_ELEMENTWISE):
        raise ValueError(
            f"{type(optimizer).__name__} is not elementwise (it keeps global or per-tensor state), so a fused step "
            "would change its results; use its plain step()"
        )
    if chunk_bytes is not None and chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive or None (automatic), got {chunk_bytes}")
    if replace_step and "step" in vars(optimizer):
        warnings.warn(
            "optimizer.step was already wrapped on this instance (an LR scheduler?); replace_step=True replaces "
            "that wrapper. Create LR schedulers after fuse_optimizer.",
            stacklevel=2,
        )
    fuser = _Fuser(optimizer, do_flatten, check_flatten, chunk_bytes)
    setattr(optimizer, _ATTR, fuser)
    optimizer._bagua_check_flatten = do_flatten and check_flatten
    optimizer._bagua_fused_count = 0
    optimizer.fuse_step = types.MethodType(fuse_step, optimizer)
    if replace_step:
        optimizer.step = types.MethodType(fuse_step, optimizer)
    return optimizer


def is_fused_optimizer(optimizer: Any) -> bool:
    """Return whether :func:`fuse_optimizer` was applied to ``optimizer``."""
    return isinstance(getattr(optimizer, _ATTR, None), _Fuser)


def fuse_step(optimizer: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
    """Run one step of a fused ``optimizer`` over its flat buffers; bound as ``optimizer.fuse_step``.

    ``closure`` is called once, before the step (with gradients enabled), so that the gradients it produces are
    the ones fused. The optimizer's step hooks run as for ``step()``; while they run, ``optimizer.param_groups``
    holds the fused groups (their tensors alias the real ones).

    Returns:
        The closure's return value, or None.
    """
    fuser = getattr(optimizer, _ATTR, None)
    if not isinstance(fuser, _Fuser):
        raise RuntimeError("fuse_step needs a fused optimizer: call fuse_optimizer(optimizer) first")
    return fuser.step(closure)


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
        # stats
        "fused_count",
    )

    def __init__(self, optimizer, do_flatten: bool, check_flatten: bool, chunk_bytes: Optional[int]):
        self.do_flatten, self.check_flatten, self.chunk_bytes = do_flatten, check_flatten, chunk_bytes
        self.optimizer = optimizer
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
        fused_groups, fused_state = self._materialize()
        saved = opt.param_groups, opt.state
        opt.param_groups, opt.state = fused_groups, fused_state
        self.in_step = True
        try:
            type(opt).step(opt)  # the class's step: its hooks run with this optimizer, not a copy
        except BaseException:
            self.plan, self.dirty = None, True
            raise
        finally:
            opt.param_groups, opt.state = saved
            self.in_step = False
        plan = self.plan
        self._write_back(fused_groups, fused_state)
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
        return [
            make_runs(lay.segments, group_codes, lay.loose, self.optimizer.state, self.chunk_bytes)
            for lay, group_codes in zip(self.layouts, codes)
        ]

    def _materialize(self):
        """Build the param groups and state that the optimizer's own ``step`` will see."""
        opt, fused_state = self.optimizer, defaultdict(dict)
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


# ------------------------------------------------------------------------ the original's grouping helper
# (kept apart from the fuser above, which finds its runs itself; exported for code written against the original)
__all__ += ["calculate_mutual_groups"]


def calculate_mutual_groups(tensors_list: list[list[torch.Tensor]]) -> list[list[int]]:
    """Group the indices whose tensors lie back to back in memory in *every* list (the original's helper).

    For each list, the tensors are ordered by address and cut into maximal runs of at least two tensors in which
    each one starts where the previous one ends, in the same storage; a run is reported as its indices in address
    order. The result holds the runs found, identical, in every list: the positions that can be fused as one flat
    tensor for all of them (say parameters, gradients and an optimizer state).

    Args:
        tensors_list: lists of equal length; ``tensors_list[j][i]`` is the j-th tensor of position ``i``.

    Returns:
        The common runs, in the first list's address order; ``[]`` when there is none.

    Example:
        >>> flat = torch.zeros(30)
        >>> calculate_mutual_groups([[flat[10:20], flat[:10], torch.zeros(10)]])
        [[1, 0]]
    """
    if not tensors_list:
        return []
    size = len(tensors_list[0])
    if any(len(tensors) != size for tensors in tensors_list):
        raise ValueError(f"every list must hold the same number of tensors, got {[len(t) for t in tensors_list]}")
    common = _contiguous_runs(tensors_list[0])
    for tensors in tensors_list[1:]:
        runs = _contiguous_runs(tensors)
        common = [run for run in common if run in runs]
    return common


def _contiguous_runs(tensors: list[torch.Tensor]) -> list[list[int]]:
    order = sorted(range(len(tensors)), key=lambda i: tensors[i].data_ptr())
    runs: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and not _follows(tensors[current[-1]], tensors[i]):
            if len(current) > 1:
                runs.append(current)
            current = []
        current.append(i)
    if len(current) > 1:
        runs.append(current)
    return runs


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` starts where ``a`` ends, inside the same storage (separate allocations never count)."""
    same_storage = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    return same_storage and a.device == b.device and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
