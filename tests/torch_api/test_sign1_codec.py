"""``sign1`` (bagua/torch_api/codecs/sign1.py, through codecs.block): the codes by hand, what its scale is,
constant and non-finite blocks, and its registry entry.

Bit-identity with the formula written plainly (``_reference_sign1``: mean and mean absolute deviation reduced in
float64, one bit ``x - mu > 0`` per value, ``mu + s * (+-1)``, block by block, sharing no code with the codec) and
the stated bound are tested with nf2's in test_block_codec.py (``test_centred_codes_...``), CUDA there too.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from bagua.torch_api.codecs import block as bc


def test_sign1_codes_written_out_by_hand():
    """A block of 10 (eighths of 2): mean 1, mean absolute deviation 2; values above the mean code 1."""
    x = torch.tensor([-3.0, 1.0, 5.0, 2.0, -1.0, 0.0, 4.0, 1.0, -2.0, 3.0])
    wire = bc.encode(x, "sign1", 10)
    mu, s = wire[:8].view(torch.float32).tolist()
    assert (mu, s) == (1.0, 2.0)
    q = [0, 0, 1, 1, 0, 0, 1, 0, 0, 1]  # 1.0 is not above the mean
    # bit j of byte i holds element i + 2 j
    assert wire[8:].tolist() == [sum(q[2 * j] << j for j in range(5)), sum(q[2 * j + 1] << j for j in range(5))]
    assert_close(bc.decode(wire, 10, "sign1", 10), torch.tensor([1.0 + s * (2 * c - 1) for c in q]), rtol=1e-6,
                 atol=0)
    assert bc.wire_numel(256 * 64, "sign1", 256) == 64 * (8 + 32)  # 1.25 bits per value


def test_sign1_keeps_the_least_squares_scale():
    """What the scale is: for the block's bits, ``s`` minimizes the squared error, so any other scale (here 0.8 and
    1.25 times it, and nf2's normal level 0.7979 x RMS on a heavy tail) leaves a larger error."""
    torch.manual_seed(8)
    x = torch.distributions.StudentT(3.0).sample((64 * 256,))
    y = bc.decode(bc.encode(x, "sign1", 256), x.numel(), "sign1", 256)
    err = float((x - y).norm())
    xb, yb = x.view(-1, 256), y.view(-1, 256)
    mu = xb.double().mean(dim=1, keepdim=True).float()
    sign = torch.where(xb - mu > 0, 1.0, -1.0)
    rms = (xb - mu).square().mean(dim=1, keepdim=True).sqrt()
    for scale in ((yb - mu).abs() * 0.8, (yb - mu).abs() * 1.25, rms * 0.7979):
        assert err < float((xb - (mu + scale * sign)).norm())
    assert err < float(x.norm())  # it keeps signal: better than sending nothing


def test_sign1_constant_and_non_finite_blocks():
    x = torch.cat([torch.full((64,), 0.5), torch.randn(64), torch.randn(64), torch.randn(7)])
    x[64 + 64 + 3], x[-1] = float("nan"), float("inf")
    y = bc.decode(bc.encode(x, "sign1", 64), x.numel(), "sign1", 64)
    assert torch.equal(y[:64], x[:64])  # a constant block decodes to itself
    assert bool(torch.isfinite(y[64:128]).all())  # its neighbours are untouched
    assert not bool(torch.isfinite(y[128:192]).any()) and not bool(torch.isfinite(y[192:]).any())
    assert bool(torch.isinf(bc.error_bound(x, "sign1", 64)[128:]).all())


def test_sign1_is_a_registry_name_for_pseudo_gradients_only():
    from bagua.torch_api.algorithms.diloco import DiLoCoSettings
    from bagua.torch_api.codecs.registry import GlobalCodecRegistry, resolve_codec

    assert resolve_codec("sign1").block_codec == "sign1"
    assert "sign1" not in GlobalCodecRegistry.available(for_gradients=True)
    assert DiLoCoSettings(compression="sign1", block_size=256).compression == "sign1"
