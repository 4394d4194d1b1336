"""Block-wise codecs: bit-identity with the formulas written plainly, the stated bound, wire format, edge cases.

``_reference`` below restates the formulas of ``bagua.torch_api.codecs.block``'s docstring with whole-tensor torch
operations (the short last block padded with copies of its last element, which leaves its min/max unchanged) and
shares no code with the module; the codec streams the same float32 operations piece by piece, so wire bytes and
decoded values must be identical (exact comparisons).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from bagua.torch_api.codecs import block as bc
BIG = torch.finfo(torch.float32).max


def _reference_nf2(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(wire bytes, decoded values) of ``x`` by ``normal2``'s docstring, block by block."""
    levels = torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104])
    headers, codes, values = [], [], []
    for a in range(0, x.numel(), block):
        xb = x[a : a + block]
        m, h = xb.numel(), -(-xb.numel() // 4)
        mu = xb.double().mean().float()
        rms = (xb.double() - mu.double()).pow(2).mean().sqrt().float()
        c, t = xb - mu, rms * 0.9816
        q = (c > -t).to(torch.uint8) + (c > 0).to(torch.uint8) + (c > t).to(torch.uint8)
        quarters = torch.cat([q, torch.zeros(4 * h - m, dtype=torch.uint8)]).view(4, h).long()
        codes.append(sum(quarters[j] << (2 * j) for j in range(4)).to(torch.uint8))
        headers.append(torch.stack([mu, rms]) + 0.0)
        values.append(mu + rms * levels[q.long()])
    if not headers:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0)
    header = torch.cat(headers).contiguous().view(torch.uint8)
    return torch.cat([header] + codes), torch.cat(values)


def _reference_sign1(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(wire bytes, decoded values) of ``x`` by ``sign1``'s docstring, block by block."""
    headers, codes, values = [], [], []
    for a in range(0, x.numel(), block):
        xb = x[a : a + block]
        m, h = xb.numel(), -(-xb.numel() // 8)
        mu = xb.double().mean().float()
        s = (xb.double() - mu.double()).abs().mean().float()
        q = ((xb - mu) > 0).to(torch.uint8)
        eighths = torch.cat([q, torch.zeros(8 * h - m, dtype=torch.uint8)]).view(8, h).long()
        codes.append(sum(eighths[j] << j for j in range(8)).to(torch.uint8))
        headers.append(torch.stack([mu, s]) + 0.0)
        values.append(mu + s * (2.0 * q.float() - 1.0))
    if not headers:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0)
    header = torch.cat(headers).contiguous().view(torch.uint8)
    return torch.cat([header] + codes), torch.cat(values)


def _reference(x: torch.Tensor, codec: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(wire bytes, decoded values) of ``x`` by the module docstring's formulas."""
    if codec == "nf2":
        return _reference_nf2(x, block)
    if codec == "sign1":
        return _reference_sign1(x, block)
    levels = {"uint8": 255, "uint4": 15}[codec]
    n = x.numel()
    blocks = -(-n // block)
    pad = blocks * block - n
    xp = torch.cat([x, x[-1:].expand(pad)]).view(blocks, block)
    mn, mx = xp.amin(dim=1, keepdim=True), xp.amax(dim=1, keepdim=True)
    finite = torch.isfinite(mn) & torch.isfinite(mx)
    huge = finite & (torch.maximum(mn.abs(), mx.abs()) >= 2.0**126)
    half = torch.where(huge, 0.5, 1.0)
    xs, lo, hi = xp * half, mn * half, mx * half
    lv = torch.full_like(lo, float(levels))
    s = torch.div(lv, hi - lo)
    s = torch.where(torch.isfinite(s), s, 0.0)
    q = torch.round((xs - lo) * s)
    q = torch.where(finite, q, 0.0).to(torch.uint8)
    y = lo + q.float() * torch.div(hi - lo, lv)
    y = torch.where(huge, torch.minimum(torch.maximum(y * 2, mn), mx), y)
    y = torch.where(finite, y, float("nan")).view(-1)[:n]
    codes = []
    for i in range(blocks):
        m = min(block, n - i * block)
        qi = q[i, :m]
        if levels == 15:
            h = (m + 1) // 2
            second = torch.cat([qi[h:], torch.zeros(2 * h - m, dtype=torch.uint8)])
            qi = qi[:h] + second * 16
        codes.append(qi)
    header = (torch.cat([mn, mx], dim=1) + 0.0).contiguous().view(-1).view(torch.uint8)  # a zero as +0
    return torch.cat([header] + codes), y


def _uniform(n: int, lo: float, hi: float) -> torch.Tensor:
    return torch.rand(n, dtype=torch.float64).mul(hi - lo).add(lo).float()


DATA = {
    "normal": lambda b: torch.randn(5 * b + 17),
    "one_element": lambda b: torch.tensor([3.25]),
    "odd_short": lambda b: torch.randn(b // 2 + 1),
    "exact_blocks": lambda b: torch.randn(3 * b),
    "one_over": lambda b: torch.randn(2 * b + 1),
    "constant_blocks": lambda b: torch.cat([torch.full((b,), 0.5), torch.zeros(b), torch.full((b + 3,), -7.25)]),
    "signed_zeros": lambda b: torch.tensor([0.0, -0.0] * b + [-0.0]),
    "tiny_range": lambda b: 1e4 + torch.randn(2 * b + 5) * 1e-3,
    "tiny_range_large_offset": lambda b: 3e7 + torch.randint(-4, 5, (2 * b + 1,)).float() * 2.0,
    "subnormal_ranges": lambda b: torch.cat([torch.randn(b) * 1e-39, torch.randn(b) * 1e-44, torch.randn(b) * 1e-37]),
    "heavy_tail": lambda b: torch.randn(3 * b + 1) ** 5,
    "large": lambda b: torch.randn(2 * b + 3) * 1e30,
    "huge": lambda b: torch.cat([_uniform(b, -BIG, BIG), _uniform(b, BIG / 2, BIG), _uniform(b, -BIG, -1e37),
                                 torch.tensor([BIG, -BIG, 1.0, -3e-40] * (b // 4 + 1)),
                                 torch.randn(b + 1).clamp(-3, 3) * 1e38]),
    "positive": lambda b: torch.rand(2 * b + 7) + 5.0,
}
BLOCKS = [64, bc.DEFAULT_BLOCK]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("codec", ["uint8", "uint4"])
@pytest.mark.parametrize("kind", sorted(DATA))
def test_bit_identical_to_the_plain_formula_and_within_the_bound(kind, codec, block):
    torch.manual_seed(sorted(DATA).index(kind))
    x = DATA[kind](block)
    wire = bc.encode(x, codec, block)
    y = bc.decode(wire, x.numel(), codec, block)
    expected_wire, expected = _reference(x, codec, block)
    assert torch.equal(wire, expected_wire)
    assert torch.equal(y, expected)
    assert bool(torch.isfinite(y).all())  # finite input: finite output, even next to the float32 limits
    err = (x.double() - y.double()).abs()
    bound = bc.error_bound(x, codec, block)
    assert bool((err <= bound.double()).all())
    # the bound is half a step plus little: per block, within 2**-19 max|x| of the largest error
    levels = 255 if codec == "uint8" else 15
    for i in range(0, x.numel(), block):
        xi, ei = x[i : i + block].double(), err[i : i + block]
        r = xi.max() - xi.min()
        slack = 2.0**-19 * xi.abs().max()
        if r > 0 and bool(bound[i] < r):
            assert float(bound[i]) <= float(r / (2 * levels) + slack) * (1 + 2**-20)


@pytest.mark.parametrize("codec", ["uint8", "uint4"])
def test_random_data_reaches_about_half_a_step(codec):
    torch.manual_seed(1)
    x = torch.rand(bc.DEFAULT_BLOCK * 4)
    err = (x - bc.decode(bc.encode(x, codec), x.numel(), codec)).abs().view(4, -1).amax(dim=1)
    half_step = (x.view(4, -1).amax(dim=1) - x.view(4, -1).amin(dim=1)) / (2 * (255 if codec == "uint8" else 15))
    assert bool((err > 0.95 * half_step).all()) and bool((err <= half_step * (1 + 1e-4)).all())


@pytest.mark.parametrize("codec", ["uint8", "uint4"])
def test_min_decodes_exactly_and_constant_blocks_decode_to_themselves(codec):
    x = torch.cat([torch.full((100,), 0.1), torch.linspace(-3.3, 7.7, 100)])
    y = bc.decode(bc.encode(x, codec, 100), 200, codec, 100)
    assert torch.equal(y[:100], x[:100])
    assert y[100] == x[100] and abs(float(y[199] - x[199])) <= 1e-6 * 7.7


@pytest.mark.parametrize("piece", [1, 3, 1 << 30])
@pytest.mark.parametrize("codec", ["uint8", "uint4"])
def test_piece_size_does_not_change_the_result(codec, piece, monkeypatch):
    """One block per piece, partial last pieces, and the whole tensor at once (the path of other devices)."""
    torch.manual_seed(2)
    x = torch.randn(10 * 64 + 33)
    wire, y = _reference(x, codec, 64)
    monkeypatch.setattr(bc, "PIECE", piece * 64)
    assert torch.equal(bc.encode(x, codec, 64), wire)
    assert torch.equal(bc.decode(wire, x.numel(), codec, 64), y)
    acc = torch.ones_like(x)
    assert torch.equal(bc.decode(wire, x.numel(), codec, 64, out=acc, accumulate=True), torch.ones_like(x) + y)


@pytest.mark.parametrize("codec", bc.CODECS)
def test_accumulate_adds_the_decoded_values(codec):
    torch.manual_seed(3)
    x = torch.randn(3 * bc.DEFAULT_BLOCK + 5)
    wire = bc.encode(x, codec)
    base = torch.randn_like(x)
    acc = bc.decode(wire, x.numel(), codec, out=base.clone(), accumulate=True)
    assert torch.equal(acc, base + bc.decode(wire, x.numel(), codec))


def test_bf16_is_torch_cast():
    torch.manual_seed(4)
    x = torch.cat([torch.randn(1001) * 10.0 ** torch.randint(-30, 30, (1001,)).float(),
                   torch.tensor([BIG, -BIG, 3.3961e38, 1e-40, -0.0, float("inf"), float("nan")])])
    wire = bc.encode(x, "bf16")
    assert torch.equal(wire, x.to(torch.bfloat16).view(torch.uint8))
    y = bc.decode(wire, x.numel(), "bf16")
    assert_close(y, x.to(torch.bfloat16).float(), rtol=0, atol=0, equal_nan=True)
    finite = torch.isfinite(y)
    err = (x.double() - y.double()).abs()[finite]
    assert bool((err <= bc.error_bound(x, "bf16").double()[finite]).all())
    assert bool(torch.isinf(bc.error_bound(x, "bf16")[~finite]).all())


@pytest.mark.parametrize("codec", ["uint8", "uint4"])
def test_non_finite_blocks_decode_to_nan_and_leave_the_others_alone(codec):
    torch.manual_seed(5)
    x = torch.randn(6 * 64 + 3)
    x[5], x[64 + 7], x[128 + 9], x[192:256] = float("nan"), float("inf"), -float("inf"), float("inf")
    x[-1] = float("nan")  # in the short last block
    wire = bc.encode(x, codec, 64)
    y = bc.decode(wire, x.numel(), codec, 64)
    expected_wire, expected = _reference(x, codec, 64)
    assert torch.equal(wire, expected_wire)  # codes 0: the same bytes on every device
    bad = torch.zeros(x.numel(), dtype=torch.bool)
    for a in (0, 64, 128, 192, 384):
        bad[a : a + 64] = True
    assert bool(torch.isnan(y[bad]).all())
    assert torch.equal(y[~bad], expected[~bad])
    assert bool(torch.isinf(bc.error_bound(x, codec, 64)[bad]).all())


def test_wire_sizes():
    assert bc.wire_numel(0, "uint4") == 0 and bc.wire_numel(1, "uint4") == 9 and bc.wire_numel(3, "uint8") == 11
    assert bc.wire_numel(4097, "uint4") == 16 + 2048 + 1
    n = 10_000_000
    assert abs(bc.wire_numel(n, "uint4") / (n / 2) - 1) < 0.01  # 0.39 % of headers at the default block
    assert bc.wire_numel(n, "bf16") == 2 * n
    for codec in bc.CODECS:
        assert bc.encode(torch.randn(12_345), codec).numel() == bc.wire_numel(12_345, codec)
        assert bc.encode(torch.empty(0), codec).numel() == 0
        assert bc.decode(torch.empty(0, dtype=torch.uint8), 0, codec).numel() == 0


@pytest.mark.parametrize("codec", bc.CODECS)
def test_unaligned_wire_slices(codec):
    """A chunk's wire may start at any byte of a larger buffer (its float32 headers are then read by copy)."""
    torch.manual_seed(6)
    x = torch.randn(301)
    wire = bc.encode(x, codec, 64)
    buf = torch.zeros(wire.numel() + 3, dtype=torch.uint8)
    bc.encode(x, codec, 64, out=buf[3:])
    assert torch.equal(buf[3:], wire)
    assert torch.equal(bc.decode(buf[3:], 301, codec, 64), bc.decode(wire, 301, codec, 64))


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="unknown codec 'int4'; available: bf16, uint8, uint4"):
        bc.encode(torch.randn(3), "int4")
    with pytest.raises(ValueError, match="even"):
        bc.wire_numel(10, "uint4", 63)
    with pytest.raises(ValueError, match="1-D float32"):
        bc.encode(torch.randn(3, dtype=torch.float64), "uint8")
    with pytest.raises(ValueError, match="wire_numel"):
        bc.encode(torch.randn(10), "uint8", out=torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="wire_numel"):
        bc.decode(torch.empty(10, dtype=torch.uint8), 10, "uint8")
    with pytest.raises(ValueError, match="pass the out tensor"):
        bc.decode(bc.encode(torch.randn(10), "uint8"), 10, "uint8", accumulate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("codec", [c for c in bc.CODECS if c not in ("nf2", "sign1")])  # test_centred_codes_on_cuda_...
def test_cuda_gives_the_same_bytes_and_values_as_cpu(codec):
    torch.manual_seed(7)
    x = torch.cat([torch.randn(100_003), DATA["huge"](64), DATA["tiny_range"](64), torch.tensor([float("nan")])])
    wire = bc.encode(x, codec)
    y = bc.decode(wire, x.numel(), codec)
    wire_gpu = bc.encode(x.cuda(), codec).cpu()
    bytes_cpu, bytes_gpu = wire, wire_gpu
    if codec == "bf16":  # the cast's NaN bits are the device's own (CPU vector code 0xFFFF, CUDA 0x7FFF)
        nan = torch.isnan(wire.view(torch.bfloat16)) & torch.isnan(wire_gpu.view(torch.bfloat16))
        assert int(nan.sum()) == 1
        bytes_cpu, bytes_gpu = (w.view(torch.int16).masked_fill(nan, 0).view(torch.uint8) for w in (wire, wire_gpu))
    assert torch.equal(bytes_gpu, bytes_cpu)
    assert_close(bc.decode(wire_gpu.cuda(), x.numel(), codec).cpu(), y, rtol=0, atol=0, equal_nan=True)


# -- nf2: 2-bit codes about each block's mean and RMS (bagua.torch_api.codecs.normal2) -------------------------------

NF2_DATA = sorted(set(DATA) - {"huge"})  # "huge": 1.51 RMS (nf2) or mean + deviation (sign1) may pass float32's largest


@pytest.mark.parametrize("block", [64, 256, 1000])
@pytest.mark.parametrize("kind", NF2_DATA)
@pytest.mark.parametrize("codec", ["nf2", "sign1"])
def test_centred_codes_bit_identical_to_the_plain_formula_and_within_the_bound(codec, kind, block):
    """nf2 and sign1 (tests/torch_api/test_sign1_codec.py holds sign1's own cases)."""
    torch.manual_seed(sorted(DATA).index(kind))
    x = DATA[kind](block)
    wire = bc.encode(x, codec, block)
    expected_wire, expected = _reference(x, codec, block)
    assert torch.equal(wire, expected_wire)
    y = bc.decode(wire, x.numel(), codec, block)
    assert torch.equal(y, expected)
    assert bool(torch.isfinite(y).all())
    assert bool(((x.double() - y.double()).abs() <= bc.error_bound(x, codec, block).double()).all())


def test_nf2_codes_written_out_by_hand():
    """A block of 5 (quarters of 2): mean 0, RMS sqrt(2), thresholds 0 and +-0.9816 sqrt(2) = +-1.388."""
    x = torch.tensor([-2.0, -1.0, 2.0, 1.0, 0.0])
    wire = bc.encode(x, "nf2", 6)
    mu, rms = wire[:8].view(torch.float32).tolist()
    assert mu == 0.0 and rms == pytest.approx(2.0**0.5, rel=1e-6)
    q = [0, 1, 3, 2, 1]  # -2 < -1.388; -1.388 < -1 < 0; 2 > 1.388; 0 < 1 < 1.388; 0 is not above 0
    assert wire[8:].tolist() == [q[0] + 4 * q[2] + 16 * q[4], q[1] + 4 * q[3]]  # bits 2j of byte i: i + 2j
    levels = [-1.5104, -0.4528, 0.4528, 1.5104]
    assert_close(bc.decode(wire, 5, "nf2", 6), torch.tensor([levels[c] * rms for c in q]), rtol=1e-6, atol=0)


def test_nf2_beats_two_bit_min_max_codes_on_heavy_tails():
    """What it is for: on heavy-tailed values (a pseudo-gradient's) 2-bit min/max steps are coarser than the bulk
    of the values; nf2 at 2.25 bits per value keeps most of the signal (relative L2 error well below 1)."""
    torch.manual_seed(8)
    x = torch.distributions.StudentT(3.0).sample((64 * 256,))
    y = bc.decode(bc.encode(x, "nf2", 256), x.numel(), "nf2", 256)
    rel = float((x - y).norm() / x.norm())
    xb = x.view(-1, 256)
    mn, mx = xb.amin(dim=1, keepdim=True), xb.amax(dim=1, keepdim=True)
    minmax2 = (mn + torch.round((xb - mn) / (mx - mn) * 3) * (mx - mn) / 3).view(-1)
    assert rel < 0.6 and rel < 0.75 * float((x - minmax2).norm() / x.norm())
    assert bc.wire_numel(x.numel(), "nf2", 256) == 64 * (8 + 64)  # 2.25 bits per value


def test_nf2_constant_and_non_finite_blocks():
    x = torch.cat([torch.full((64,), 0.5), torch.randn(64), torch.randn(64), torch.randn(7)])
    x[64 + 64 + 3], x[-1] = float("nan"), float("inf")
    y = bc.decode(bc.encode(x, "nf2", 64), x.numel(), "nf2", 64)
    assert torch.equal(y[:64], x[:64])  # a constant block decodes to itself
    assert bool(torch.isfinite(y[64:128]).all())  # its neighbours are untouched
    assert not bool(torch.isfinite(y[128:192]).any()) and not bool(torch.isfinite(y[192:]).any())
    assert bool(torch.isinf(bc.error_bound(x, "nf2", 64)[128:]).all())


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["nf2", "sign1"])
def test_centred_codes_on_cuda_decode_the_cpu_bytes_bit_for_bit(codec):
    torch.manual_seed(9)
    x = torch.randn(100_003) ** 3
    wire = bc.encode(x, codec, 256)
    y = bc.decode(wire, x.numel(), codec, 256)
    assert torch.equal(bc.decode(wire.cuda(), x.numel(), codec, 256).cpu(), y)  # decoding is elementwise
    wire_gpu = bc.encode(x.cuda(), codec, 256).cpu()
    # the float64 reductions may round a header to another float32 on another device: rare, not never
    assert float((wire_gpu == wire).float().mean()) > 0.999
    y_gpu = bc.decode(wire_gpu, x.numel(), codec, 256)
    assert bool(((x.double() - y_gpu.double()).abs() <= bc.error_bound(x, codec, 256).double()).all())
