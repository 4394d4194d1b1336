"""The compiled fused step: the optimizer's own ``step`` over the flat buffers, compiled by ``torch.compile``.

Part of :mod:`bagua.torch_api.contrib.fuse.optimizer` (``fuse_optimizer(optimizer, compile=True)``). The eager fused
step runs each elementwise operation of the optimizer as one pass over a flat chunk (about 10 passes for Adam, 6 for
Lion); compiled, Inductor turns the whole update of a run into one loop (vectorized C++ with OpenMP on CPU, Triton on
GPU) that reads the parameter, gradient and state once and writes them once. That is the memory limit of a step.

How, for any optimizer:

1. The step's body (the class's ``step`` without torch's hook wrapper) is compiled with ``dynamic=False``: guards on
   the layout (one flat tensor per run: shapes, dtypes, state keys), so it compiles once per layout.
2. Hyper-parameters in :attr:`CompiledStep.dynamic` (``lr`` from the start, then any float that changes between
   steps, e.g. betas under ``OneCycleLR``) are handed to the step as 0-dim float64 tensors filled before each
   step: a new value is new data, not a new guard, so an LR schedule does not recompile. Other floats are
   constants of the compiled code (a change recompiles once and turns that key dynamic).
3. The step hooks run eagerly around the compiled body, as torch's wrapper runs them (they may communicate).
4. When compiling is impossible (no C++ compiler or Triton, Dynamo cannot trace the step), the exact eager fused
   step runs instead, with one warning.

Compiled code rounds differently from eager code (the order of a fused expression's operations, ``1 - beta`` in
float64 instead of a Python double...): it is not bitwise equal to ``step()``; see docs/fused_optimizer.md for the
measured differences and the tolerance tested.
"""

from __future__ import annotations

import logging
import shutil
from itertools import chain
from typing import Any, Callable, Optional

import torch

__all__ = ["CompiledStep", "compile_unavailable"]

logger = logging.getLogger(__name__)


def compile_unavailable(device: torch.device) -> Optional[str]:
    """Return why ``torch.compile`` cannot compile a step for ``device`` here, or None when it can.

    Example:
        >>> compile_unavailable(torch.device("meta"))
        'no torch.compile backend for meta tensors'
    """
    if device.type == "cpu":
        if not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
            return "no C++ compiler (g++, c++, clang++) on PATH for Inductor's CPU code"
        return None
    if device.type == "cuda":
        try:
            import triton  # noqa: F401  - Inductor's GPU code generator
        except ImportError:
            return "Triton is not installed (Inductor's GPU code generator)"
        return None
    return f"no torch.compile backend for {device.type} tensors"


class CompiledStep:
    """One optimizer's compiled step body, the tensors that carry its dynamic hyper-parameters, and its verdict.

    Fields: ``fn`` (the caller compiled by ``torch.compile``), ``dynamic`` (hyper-parameter keys passed as tensors),
    ``tensors`` (``(group index, key)`` -> the tensor or tuple of tensors handed to the step), ``last`` (each float
    hyper-parameter's value at the last step, to find the ones that change), ``failed`` (why compiling failed; the
    eager step runs from then on).
    """

    __slots__ = ("fn", "dynamic", "tensors", "last", "failed")

    def __init__(self) -> None:
        self.fn = torch.compile(_call, dynamic=False)
        self.dynamic: set[str] = {"lr"}
        self.tensors: dict[tuple[int, str], Any] = {}
        self.last: dict[tuple[int, str], Any] = {}
        self.failed: Optional[str] = None

    def step(
        self, opt: torch.optim.Optimizer, real_groups: list[dict], fused_groups: list[dict], run_states: list[dict]
    ) -> None:
        """Run one step of ``opt`` (whose ``param_groups`` are ``fused_groups`` now) through the compiled body.

        ``run_states`` are the fused tensors' state dicts: their Python numbers (a user's step counter) are handed
        to the step as 0-dim tensors and turned back into numbers afterwards, or every step would recompile.
        If compiling fails (Dynamo and Inductor fail while compiling, before running anything), this step runs the
        body eagerly and ``failed`` says why: the caller uses the eager step from then on.
        """
        swapped = self._hyper_parameters(real_groups, fused_groups)
        counters = _numbers_to_tensors(run_states)
        body, pre, post = _split_hooks(opt)
        try:
            for hook in pre:
                hook(opt, (), {})
            try:
                self.fn(body, opt)
            except Exception as err:  # noqa: BLE001 - any compile failure: the exact eager step is always right
                self.failed = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
                for gi, key in swapped:
                    fused_groups[gi][key] = real_groups[gi][key]
                swapped = []
                _tensors_to_numbers(counters)
                counters = []
                body(opt)
            for hook in post:
                hook(opt, (), {})
        finally:
            for gi, key in swapped:  # the real groups keep their Python numbers
                fused_groups[gi][key] = real_groups[gi][key]
            _tensors_to_numbers(counters)

    def _hyper_parameters(self, real_groups: list[dict], fused_groups: list[dict]) -> list[tuple[int, str]]:
        """Put tensors for the dynamic hyper-parameters into ``fused_groups``; return the keys replaced."""
        swapped = []
        for gi, (group, fused) in enumerate(zip(real_groups, fused_groups)):
            for key, value in group.items():
                if key == "params" or not _numbers(value):
                    continue
                if key not in self.dynamic:
                    if self.last.setdefault((gi, key), value) != value:
                        logger.info("fuse_step: hyper-parameter %r changed; it is passed as a tensor from now on "
                                    "(one recompile)", key)
                        self.dynamic.add(key)
                    continue
                fused[key] = self._fill(gi, key, value)
                swapped.append((gi, key))
        return swapped

    def _fill(self, gi: int, key: str, value: Any) -> Any:
        held = self.tensors.get((gi, key))
        values = value if isinstance(value, tuple) else (value,)
        if held is None or len(held if isinstance(held, tuple) else (held,)) != len(values):
            made = tuple(torch.tensor(float(v), dtype=torch.float64) for v in values)
            held = self.tensors[(gi, key)] = made if isinstance(value, tuple) else made[0]
        for t, v in zip(held if isinstance(held, tuple) else (held,), values):
            t.fill_(float(v))
        return held


def _numbers(value: Any) -> bool:
    """Whether ``value`` is a float hyper-parameter (or a tuple of floats, such as ``betas``); ints and bools are
    left alone (they count things and pick branches)."""
    if isinstance(value, tuple):
        return bool(value) and all(type(v) is float for v in value)
    return type(value) is float


def _numbers_to_tensors(states: list[dict]) -> list[tuple[dict, Any, type]]:
    """Replace the int and float values of ``states`` by 0-dim tensors; return what to turn back."""
    out = []
    for st in states:
        for key, value in st.items():
            if type(value) in (int, float):
                st[key] = torch.tensor(value, dtype=torch.int64 if type(value) is int else torch.float64)
                out.append((st, key, type(value)))
    return out


def _tensors_to_numbers(replaced: list[tuple[dict, Any, type]]) -> None:
    for st, key, kind in replaced:
        value = st[key]
        st[key] = kind(value.item()) if isinstance(value, torch.Tensor) else value


def _call(body: Callable[[Any], Any], opt: torch.optim.Optimizer) -> Any:
    return body(opt)


def _split_hooks(opt: torch.optim.Optimizer) -> tuple[Callable[[Any], Any], list, list]:
    """Return the class's step without torch's hook wrapper, and the step pre- and post-hooks to run around it.

    torch.optim wraps every optimizer class's ``step`` (``Optimizer.profile_hook_step``, marked ``hooked``) so that
    it runs the global and per-optimizer step hooks; no public API runs the body apart from them. The hooks must stay
    outside the compiled region (Bagua's engine and QAdam communicate in them), so this one helper reads the two
    private hook registries, in the wrapper's order. A class whose ``step`` is not wrapped is compiled whole.
    """
    step = type(opt).step
    body = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if body is None:
        return step, [], []
    from torch.optim import optimizer as torch_optimizer

    pre = list(chain(torch_optimizer._global_optimizer_pre_hooks.values(), opt._optimizer_step_pre_hooks.values()))
    post = list(chain(opt._optimizer_step_post_hooks.values(), torch_optimizer._global_optimizer_post_hooks.values()))
    return body, pre, post
