"""MinMaxUInt8 codec: error bound, bit-identity with the formula written plainly, wire format, edge cases.

The reference formula below is the original Bagua's (``min(round(x*scale), upper) - lower``), written with
whole-tensor torch ops; the codec computes the same float32 operations block by block, so codes and decoded
values must be identical (exact comparisons). The round-trip bound is half a quantization step,
``(max - min + eps) / 510``, plus float32 rounding of the decode, ``1e-6 * max|x|``.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from bagua.torch_api.codecs import codec_format, minmax_uint8 as codec
def _plain_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and decoded values of each row of ``x``, by the formula of the module docstring."""
    x = x.float()
    mn, mx = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    scale = 255.0 / (mx - mn + 1e-7)
    upper = torch.round(mx * scale)
    lower = upper - 255.0
    q = (torch.minimum(torch.round(x * scale), upper) - lower).to(torch.uint8)
    return q, (q.float() + lower) / scale


def _roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, length = x.shape
    wire = codec.wire_buffer(n, length)
    codec.encode_chunks(x, wire, codec.scratch_buffer(length))
    out = torch.empty(n, length)
    codec.decode_chunks(wire, out)
    return wire, out


DATA = {
    "normal": lambda: torch.randn(3, 1000),
    "multi_block": lambda: torch.randn(2, 3 * codec.BLOCK + 17) * 1e-3,
    "positive": lambda: torch.rand(2, 500) + 5.0,
    "negative": lambda: -torch.rand(2, 500) * 1e4,
    "offset": lambda: torch.randn(2, 500) * 1e-2 + 30.0,
    "heavy_tail": lambda: torch.randn(2, 2000) ** 5,
    "one_element": lambda: torch.tensor([[3.0], [-2.0]]),
}


@pytest.mark.parametrize("kind", sorted(DATA))
def test_roundtrip_within_half_a_step(kind):
    torch.manual_seed(0)
    x = DATA[kind]()
    _, y = _roundtrip(x)
    bound = codec.quantization_error_bound(x)[:, None] + 1e-6 * x.abs().amax(dim=1, keepdim=True)
    assert bool(((x - y).abs() <= bound).all())


@pytest.mark.parametrize("kind", sorted(DATA))
def test_bit_identical_to_the_plain_formula(kind):
    torch.manual_seed(1)
    x = DATA[kind]()
    wire, y = _roundtrip(x)
    q, expected = _plain_codes(x)
    assert torch.equal(wire[:, codec.HEADER_BYTES :], q)
    assert torch.equal(y, expected)


def test_fast_path_equals_general_path(monkeypatch):
    """Rows whose codes provably need no clamp skip it (and the int32 cast); both paths give the same bytes."""
    torch.manual_seed(3)
    rows = [torch.randn(300) * 10.0 ** float(torch.randint(-8, 6, ())) + float(torch.randn(())) * 10.0 ** k
            for k in range(-3, 7) for _ in range(20)]
    x = torch.stack(rows)
    mm = codec.chunk_minmax(x)
    fast = codec_format._unclamped_rows(mm, *codec_format._scale_lower(mm))
    assert 0 < sum(fast) < len(rows)  # both paths are exercised
    wire, y = _roundtrip(x)
    monkeypatch.setattr(codec_format, "_unclamped_rows", lambda minmax, scale, lower: [False] * minmax.shape[0])
    wire_general, y_general = _roundtrip(x)
    assert torch.equal(wire, wire_general) and torch.equal(y, y_general)
    q, _ = _plain_codes(x[torch.tensor(fast)])
    assert torch.equal(wire[torch.tensor(fast), codec.HEADER_BYTES :], q)


def test_constant_and_zero_chunks_decode_to_themselves():
    x = torch.stack([torch.zeros(100), torch.full((100,), 0.5), torch.full((100,), -7.25)])
    _, y = _roundtrip(x)
    assert_close(y, x, rtol=1e-6, atol=1e-7)


def test_header_holds_min_and_max_as_float32():
    x = torch.tensor([[1.5, -2.25, 4.0], [0.0, 1.0, 2.0]])
    wire, _ = _roundtrip(x)
    header = wire[:, : codec.HEADER_BYTES].contiguous().view(torch.float32)
    assert torch.equal(header, torch.tensor([[-2.25, 4.0], [0.0, 2.0]]))
    assert wire.shape == (2, codec.HEADER_BYTES + 3) and wire.dtype == torch.uint8


def test_block_size_does_not_change_the_result(monkeypatch):
    torch.manual_seed(2)
    x = torch.randn(3, 1001)
    wire, y = _roundtrip(x)
    monkeypatch.setattr(codec, "BLOCK", 7)
    wire_small, y_small = _roundtrip(x)
    assert torch.equal(wire_small, wire) and torch.equal(y_small, y)


def test_whole_tensor_path_equals_the_blocked_path(monkeypatch):
    """The path other devices (CUDA) take, run on CPU, gives the same bytes and values."""
    torch.manual_seed(3)
    x = torch.randn(4, 999)
    wire, y = _roundtrip(x)
    monkeypatch.setattr(codec, "_blocked", lambda t: False)
    wire_vec, y_vec = _roundtrip(x)
    assert torch.equal(wire_vec, wire) and torch.equal(y_vec, y)
    out = torch.empty(999)
    codec.decode_sum_chunks(wire, out)
    expected = y[0] + y[1] + y[2] + y[3]
    assert torch.equal(out, expected)


def test_segments_encoded_with_the_chunk_minmax_equal_the_whole_chunk():
    torch.manual_seed(4)
    x = torch.randn(2, 1000)
    whole, _ = _roundtrip(x)
    minmax = codec.chunk_minmax(x)
    for a, b in [(0, 300), (300, 999), (999, 1000)]:
        part = codec.wire_buffer(2, b - a)
        codec.encode_chunks(x[:, a:b], part, minmax=minmax)
        assert torch.equal(part[:, : codec.HEADER_BYTES], whole[:, : codec.HEADER_BYTES])
        h = codec.HEADER_BYTES
        assert torch.equal(part[:, h:], whole[:, h + a : h + b])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_decode_sum_adds_rows_in_order(n, monkeypatch):
    torch.manual_seed(5)
    monkeypatch.setattr(codec, "BLOCK", 64)
    x = torch.randn(n, 300)
    wire, y = _roundtrip(x)
    expected = y[0].clone()
    for i in range(1, n):
        expected = expected + y[i]
    out = torch.empty(300)
    codec.decode_sum_chunks(wire, out, codec.scratch_buffer(300))
    assert torch.equal(out, expected)
    half = torch.empty(300, dtype=torch.float16)
    codec.decode_sum_chunks(wire, half)
    assert torch.equal(half, expected.half())


def test_decode_accumulate_and_half_precision():
    torch.manual_seed(6)
    x = torch.randn(2, 100)
    wire, y = _roundtrip(x)
    acc = torch.ones(2, 100)
    codec.decode_chunks(wire, acc, accumulate=True)
    assert torch.equal(acc, torch.ones(2, 100) + y)
    half = torch.empty(2, 100, dtype=torch.float16)
    codec.decode_chunks(wire, half)
    assert torch.equal(half, y.half())
    wire16 = codec.wire_buffer(2, 100)
    codec.encode_chunks(x.half(), wire16)
    q, _ = _plain_codes(x.half())
    assert torch.equal(wire16[:, codec.HEADER_BYTES :], q)


def test_empty_chunks_and_wrong_wire_shape():
    wire = codec.wire_buffer(2, 0)
    codec.encode_chunks(torch.empty(2, 0), wire)
    codec.decode_chunks(wire, torch.empty(2, 0))
    with pytest.raises(ValueError, match="wire must be a uint8 tensor of shape"):
        codec.encode_chunks(torch.randn(2, 10), codec.wire_buffer(2, 9))
    with pytest.raises(ValueError, match="wire_buffer"):
        codec.decode_chunks(torch.zeros(2, 18, dtype=torch.float32), torch.empty(2, 10))


def test_decodes_finite_matches_decoding_every_code():
    # headers from ordinary ranges to ranges at the float32 limits, where scale is 0 or a decoded end overflows
    big = torch.finfo(torch.float32).max
    rows = [(-1.0, 1.0), (0.0, 0.0), (5.0, 5.0), (-1e-30, 1e-30), (1e30, 2e30), (-big, -big / 2), (-big / 2, big / 2),
            (-big, big), (big / 2, big), (-big, 0.0), (0.0, float("inf")), (float("nan"), 1.0), (-float("inf"), 0.0)]
    codes = torch.arange(256, dtype=torch.float32)
    for mn, mx in rows:
        params = codec.ChunkParams(torch.tensor([[mn, mx]]))
        # every value a code can decode to, by the plain formula
        every = (codes + params.lower) / params.scale
        assert params.decodes_finite() == bool(torch.isfinite(every).all()), (mn, mx)
    mixed = codec.ChunkParams(torch.tensor([[-1.0, 1.0], [-big, big]]))
    assert not mixed.decodes_finite()  # one bad chunk is enough


@pytest.mark.gpu
def test_cuda_gives_the_same_codes_as_cpu():
    torch.manual_seed(7)
    x = torch.randn(4, 100_003)
    wire, y = _roundtrip(x)
    wire_gpu = codec.wire_buffer(4, 100_003, "cuda")
    codec.encode_chunks(x.cuda(), wire_gpu)
    out = torch.empty(4, 100_003, device="cuda")
    codec.decode_chunks(wire_gpu, out)
    # CUDA may divide by multiplying with the reciprocal: decoded values agree to float32 rounding
    mismatched = (wire_gpu.cpu() != wire).float().mean().item()
    assert mismatched < 1e-4
    assert_close(out.cpu(), y, rtol=1e-6, atol=1e-6)
