"""The compiled fused step (``fuse_optimizer(..., compile=True)``): within tolerance of ``step()``, no recompile on
an LR schedule, and the exact eager step wherever compiling is impossible.

Tolerance: after 100 steps with fresh gradients and a learning rate that changes every step, the largest difference
between compiled and unfused parameters is at most ``TOLERANCE`` times the largest parameter magnitude. Measured
on these shapes (float32, torch 2.13, CPU): Adam 1e-6, AdamW 7e-7, SGD with momentum 9e-8, Adagrad 7e-8, Lion 0.

Each compiled optimizer costs one Inductor compile (a few seconds warm, 10-40 s cold), so the default run compiles
Adam only; the other optimizers are marked ``slow`` (run them with ``--runslow``).
"""

from __future__ import annotations

import copy
import logging
import shutil

import pytest
import torch

from bagua.torch_api.contrib import fuse_optimizer
from tests.contrib.test_fused_optimizer import OPTIMIZERS, grads_for, make_params, set_grads

TOLERANCE = 1e-5
STEPS = 100
#: the compiled tests need Inductor's C++ compiler; without one the fallback tests below still run
needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                    reason="no C++ compiler for torch.compile's CPU code")


@pytest.fixture
def bagua_log(caplog):
    """Bagua's records (its logger does not propagate to the root logger, where ``caplog`` listens)."""
    logger = logging.getLogger("bagua")
    logger.addHandler(caplog.handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield caplog
    logger.setLevel(level)
    logger.removeHandler(caplog.handler)


def _train_pair(name: str, steps: int = STEPS, lock_after: int = 3, device: str = "cpu"):
    """Step an unfused and a compiled fused optimizer on the same fresh gradients and LR schedule.

    From step ``lock_after`` on, any recompile raises inside the compiled call (``fail_on_recompile``), which
    makes the fused optimizer fall back to its eager step: the caller checks that it did not.
    """
    ref_params, params = ([torch.nn.Parameter(p.detach().to(device)) for p in make_params()] for _ in range(2))
    ref, fused = OPTIMIZERS[name](ref_params), fuse_optimizer(OPTIMIZERS[name](params), compile=True)
    try:
        for step in range(steps):
            grads = [g.to(device) for g in grads_for(ref_params, step)]
            set_grads(ref_params, grads, keep=False)  # zero_grad()'s default: new gradient tensors every step
            set_grads(params, grads, keep=False)
            for opt in (ref, fused):
                for group in opt.param_groups:
                    group["lr"] = 1e-2 * (1 - step / (2 * steps))
            if step == lock_after:
                torch.compiler.set_stance("fail_on_recompile")
            ref.step()
            fused.fuse_step()
    finally:
        torch.compiler.set_stance("default")
    return ref, fused, ref_params, params


def _relative_difference(ref_params, params) -> float:
    diff = max((a - b).abs().max().item() for a, b in zip(ref_params, params))
    return diff / max(a.abs().max().item() for a in ref_params)


def _check(name: str) -> None:
    ref, fused, ref_params, params = _train_pair(name)
    assert fused._bagua_fuser.compiled is not None, "the compiled step fell back (a recompile on the LR schedule?)"
    assert _relative_difference(ref_params, params) <= TOLERANCE
    for a, b in zip(ref_params, params):
        sa, sb = ref.state[a], fused.state[b]
        assert sa.keys() == sb.keys()
        for key, value in sa.items():
            if not isinstance(value, torch.Tensor):
                assert type(sb[key]) is type(value) and sb[key] == value, key  # Python numbers stay numbers
            elif value.dim() == 0:
                assert torch.equal(value, sb[key]), key  # step counters are exact
    assert fused._bagua_fused_count == STEPS


@needs_compiler
def test_compiled_adam_within_tolerance_without_recompiles():
    _check("adam")


def train_resumed(device: str, steps: int = 30):
    """Train an unfused and a compiled fused Adam 5 steps, load a checkpoint of the unfused one (its ``step``
    counters on the CPU) into the fused one, and step both ``steps`` more; return what ``_train_pair`` does.

    The checkpoint is a deep copy, as ``torch.save`` and ``torch.load`` give: a live optimizer's ``state_dict()``
    shares its ``step`` tensors, which the unfused optimizer would then advance for both.
    """
    ref, fused, ref_params, params = _train_pair("adam", steps=5, device=device)
    checkpoint = copy.deepcopy(ref.state_dict())
    assert all(not s["step"].is_cuda for s in checkpoint["state"].values())
    with torch.no_grad():
        for a, b in zip(ref_params, params):
            b.copy_(a)
    fused.load_state_dict(checkpoint)
    for step in range(5, 5 + steps):
        grads = [g.to(device) for g in grads_for(ref_params, step)]
        set_grads(ref_params, grads, keep=False)
        set_grads(params, grads, keep=False)
        ref.step()
        fused.fuse_step()
    return ref, fused, ref_params, params


@needs_compiler
def test_compiled_resumes_from_a_checkpoint():
    ref, fused, ref_params, params = train_resumed("cpu")
    assert fused._bagua_fuser.compiled is not None and not fused._bagua_fuser.fallback
    assert _relative_difference(ref_params, params) <= TOLERANCE
    assert all(torch.equal(ref.state[a]["step"], fused.state[b]["step"]) for a, b in zip(ref_params, params))


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "sgd_momentum", "lion", "adagrad"])
def test_compiled_within_tolerance_without_recompiles(name):
    _check(name)


def test_compile_failure_falls_back_to_the_exact_step(bagua_log):
    """A step that cannot be compiled (here: every compile refused) runs the exact eager step, bitwise."""
    ref, fused, ref_params, params = _train_pair("adam", steps=4, lock_after=0)
    assert fused._bagua_fuser.compiled is None
    assert any("compiling the step failed" in r.getMessage() for r in bagua_log.records)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))


def test_no_compiler_means_the_exact_step(monkeypatch, bagua_log):
    monkeypatch.setenv("PATH", "")
    opt = fuse_optimizer(torch.optim.SGD(make_params(), lr=0.1), compile=True)
    assert opt._bagua_fuser.compiled is None
    assert any("no C++ compiler" in r.getMessage() for r in bagua_log.records)


def test_default_is_the_exact_step(bagua_log):
    opt = fuse_optimizer(torch.optim.SGD(make_params(), lr=0.1))
    assert opt._bagua_fuser.compiled is None
    assert any("exact eager fused step" in r.getMessage() for r in bagua_log.records)
