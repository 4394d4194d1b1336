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

import logging
import types
import warnings
from typing import Any, Callable, Optional

import torch

from bagua.torch_api.contrib.fuse.compiled import compile_unavailable
from bagua.torch_api.contrib.fuse.fuser import _Fuser
from bagua.torch_api.contrib.fuse.mutual_groups import calculate_mutual_groups

# calculate_mutual_groups: the original's grouping helper, kept apart in mutual_groups.py (the fuser finds its
# runs itself) and re-exported here, its original path
__all__ = ["fuse_optimizer", "is_fused_optimizer", "fuse_step", "calculate_mutual_groups"]

logger = logging.getLogger(__name__)

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
    compile: bool = False,
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
            1.5 MiB for SGD with momentum, 1 MiB for Adam); unlimited on other devices and when compiled.
        compile: compile the step over the flat buffers with ``torch.compile`` (one loop per run instead of one
            pass per operation: 2-3x faster on CPU, see docs/fused_optimizer.md). Not bitwise equal to ``step()``:
            compiled code rounds differently (Adam's parameters after 100 steps within about 1e-5 of the largest
            one's magnitude). The first fused step of each layout runs eagerly (it may create the state), the
            second compiles (10-40 s on CPU). Falls back to the exact eager fused step, with a warning, where
            compiling is impossible (no C++ compiler or Triton; a step Dynamo cannot trace). ``lr`` and any float
            hyper-parameter that changes are passed as tensors, so an LR schedule does not recompile. False (the
            default): the exact eager fused step, bitwise equal to ``step()``.

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
    fuser = _Fuser(optimizer, do_flatten, check_flatten, chunk_bytes, compiled=_compile_choice(optimizer, compile))
    setattr(optimizer, _ATTR, fuser)
    optimizer._bagua_check_flatten = do_flatten and check_flatten
    optimizer._bagua_fused_count = 0
    optimizer.fuse_step = types.MethodType(fuse_step, optimizer)
    if replace_step:
        optimizer.step = types.MethodType(fuse_step, optimizer)
    return optimizer


def _compile_choice(optimizer: torch.optim.Optimizer, compile: bool) -> bool:
    """Decide whether the step is compiled, and say which path runs in one log line."""
    name = type(optimizer).__name__
    if not compile:
        logger.info("fuse_optimizer(%s): exact eager fused step (bitwise equal to step(); compile=True for the "
                    "compiled one)", name)
        return False
    devices = {p.device for group in optimizer.param_groups for p in group["params"]}
    why = next((w for w in map(compile_unavailable, sorted(devices, key=str)) if w is not None), None)
    if why is not None:
        logger.warning("fuse_optimizer(%s): compile=True, but %s; the exact eager fused step runs", name, why)
        return False
    logger.info("fuse_optimizer(%s): compiled fused step (torch.compile, Inductor), compiled at the second "
                "fuse_step of each layout", name)
    return True


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

