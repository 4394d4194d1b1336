"""``fuse_optimizer(..., compile=True)`` on CUDA: the compiled step runs, and keeps running after a checkpoint.

On CUDA, Dynamo's optimizer support moves a CPU ``step`` counter to the parameters' GPU and traces the step as
``capturable``, while the eager first step made the counter on the CPU. Before the fused optimizer followed that
move it took the moved counter for state it cannot fuse and ran the plain ``step()`` from the second step on
(docs/gpu.md, the first lent session): right numbers at the unfused speed. These tests fail if it falls back again.

Tolerance: the CPU tests' (``tests/contrib/test_fused_compiled.py``): after the steps, the largest parameter
difference against the unfused optimizer is at most ``TOLERANCE`` times the largest parameter magnitude; step
counters are exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.contrib.test_fused_compiled import TOLERANCE, _relative_difference, _train_pair, train_resumed

pytestmark = pytest.mark.gpu

STEPS = 30


def _same_counters(ref, fused, ref_params, params, device: str) -> None:
    for a, b in zip(ref_params, params):
        sa, sb = ref.state[a], fused.state[b]
        assert sa.keys() == sb.keys()
        assert sb["step"].device.type == device, "the compiled step keeps its counter on the parameters' device"
        assert torch.equal(sa["step"].cpu(), sb["step"].cpu())


def test_compiled_adam_on_cuda_runs_compiled():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, fused, ref_params, params = _train_pair("adam", steps=STEPS, device="cuda")
    torch.cuda.synchronize()
    fuser = fused._bagua_fuser
    assert not fuser.fallback, [str(w.message) for w in caught]
    assert fuser.compiled is not None and fuser.compiled.failed is None
    assert not [w for w in caught if "fuse_step" in str(w.message)]
    assert all(p.is_cuda for p in params)
    assert _relative_difference(ref_params, params) <= TOLERANCE
    _same_counters(ref, fused, ref_params, params, "cuda")
    assert fused._bagua_fused_count == STEPS


def test_compiled_adam_on_cuda_resumes_from_a_checkpoint_with_cpu_counters():
    """Loading the unfused optimizer's checkpoint (its ``step`` counters on the CPU) keeps the compiled step."""
    ref, fused, ref_params, params = train_resumed("cuda", steps=STEPS)
    torch.cuda.synchronize()
    fuser = fused._bagua_fuser
    assert not fuser.fallback and fuser.compiled is not None and fuser.compiled.failed is None
    assert _relative_difference(ref_params, params) <= TOLERANCE
    _same_counters(ref, fused, ref_params, params, "cuda")
