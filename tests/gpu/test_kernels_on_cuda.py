"""The codec and the fused optimizer on CUDA (issue 31): the same bits as on CPU.

- MinMaxUInt8 on CUDA gives exactly the CPU's codes (zero mismatched bytes, headers included) and the CPU's
  formula (:func:`_formula_codes`, the ``bagua.torch_api.codecs.minmax_uint8`` docstring in float32), on rows that take
  the encoder's fast path and rows that take its clamp; decoding agrees to float32 rounding.
- ``fuse_optimizer`` on CUDA steps every optimizer of the CPU parity tests bit for bit like the unfused one
  (same gradients, ``torch.equal`` on weights and state).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from bagua.torch_api.codecs import minmax_uint8 as codec
from bagua.torch_api.contrib import fuse_optimizer
from tests.contrib.test_fused_optimizer import OPTIMIZERS, STEPS, assert_same, grads_for, make_params, set_grads

pytestmark = pytest.mark.gpu

LENGTH = codec.BLOCK + 1001  # more than one CPU cache block, and not a multiple of any vector width


def _rows() -> torch.Tensor:
    """Finite rows of every kind the encoder treats apart: ordinary, constant, offset by far more than their
    range (float32 cannot hold ``x * scale`` to the unit there: the clamp path), huge and tiny ranges."""
    gen = torch.Generator().manual_seed(31)
    noise = torch.randn(LENGTH, generator=gen)
    big = torch.finfo(torch.float32).max / 4
    return torch.stack([
        noise,
        noise * 1e-3 + 5.0,
        torch.full((LENGTH,), 3.0),
        noise * 1e-2 + 1e6,
        noise * 1e30,
        (noise.sign() * big),
        noise * 1e-30,
        torch.rand(LENGTH, generator=gen) * 255.0,
    ])


def _formula_codes(x: torch.Tensor) -> torch.Tensor:
    """The encoder's formula as written in ``bagua.torch_api.codecs.minmax_uint8``, whole rows, float32 on CPU."""
    mn, mx = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    scale = 255.0 / (mx - mn + codec.EPS)
    upper = torch.round(mx * scale)
    lower = upper - 255.0
    return (torch.round(x * scale) - lower).clamp(0.0, 255.0).to(torch.uint8)


def test_cuda_codes_are_bit_identical_to_the_cpu_formula():
    x = _rows()
    n = x.shape[0]
    wire_cpu = codec.wire_buffer(n, LENGTH)
    codec.encode_chunks(x, wire_cpu)
    wire_gpu = codec.wire_buffer(n, LENGTH, "cuda")
    codec.encode_chunks(x.cuda(), wire_gpu, codec.scratch_buffer(LENGTH * n, "cuda"))
    got = wire_gpu.cpu()
    mismatched = int((got != wire_cpu).sum())
    assert mismatched == 0, f"{mismatched} of {got.numel()} wire bytes differ between CUDA and CPU"
    formula = _formula_codes(x)
    assert torch.equal(got[:, codec.HEADER_BYTES:], formula), (
        f"{int((got[:, codec.HEADER_BYTES:] != formula).sum())} codes differ from the formula")

    out_gpu = torch.empty(n, LENGTH, device="cuda")
    codec.decode_chunks(wire_gpu, out_gpu)
    out_cpu = torch.empty(n, LENGTH)
    codec.decode_chunks(wire_cpu, out_cpu)
    assert_close(out_gpu.cpu(), out_cpu, rtol=2**-23, atol=0)  # one rounding of float32 at most


def test_cuda_decode_sum_matches_cpu():
    x = _rows()[:4]
    wire = codec.wire_buffer(4, LENGTH)
    codec.encode_chunks(x, wire)
    out_cpu = torch.empty(LENGTH)
    codec.decode_sum_chunks(wire, out_cpu)
    out_gpu = torch.empty(LENGTH, device="cuda")
    codec.decode_sum_chunks(wire.cuda(), out_gpu)
    # the CPU adds each row with addcdiv, CUDA divides then adds: a rounding apart per row
    assert_close(out_gpu.cpu(), out_cpu, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_optimizer_on_cuda_is_bitwise_equal_to_unfused(name):
    ref_params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    fused_params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    ref = OPTIMIZERS[name](ref_params)
    fused = fuse_optimizer(OPTIMIZERS[name](fused_params))
    for step in range(STEPS):
        grads = [g.cuda() for g in grads_for(ref_params, step)]
        set_grads(ref_params, grads, keep=False)
        set_grads(fused_params, grads)
        ref.step()
        fused.fuse_step()
    torch.cuda.synchronize()
    assert all(p.is_cuda for p in fused_params)
    assert_same(ref, fused, ref_params, fused_params)
    assert fused._bagua_fused_count == STEPS
