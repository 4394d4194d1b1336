"""The Triton codec kernels write the CPU code's bytes and values exactly (issue 51).

Each test runs twice where it can: through Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, so CI
checks the kernels without a GPU) and compiled on CUDA (gpu-marked, skipped without a GPU). The reference is the
CPU code of :mod:`bagua.torch_api.codecs.block` and :mod:`~bagua.torch_api.codecs.minmax_uint8`, which
``tests/torch_api/test_block_codec.py`` checks against the formulas written plainly; the kernels share no code
with it. Comparisons are exact: wire bytes with ``torch.equal``, values bit for bit (a NaN matches any NaN: the bits
of a NaN that an operation makes are the device's).
"""

from __future__ import annotations

import os

import pytest
import torch
from bagua.torch_api.codecs import block as bc
from bagua.torch_api.codecs import minmax_uint8 as mm
from bagua.torch_api.codecs import triton_kernels as tk
from tests.gpu.test_kernels_on_cuda import _rows
from tests.torch_api.test_block_codec import DATA

pytest.importorskip("triton")

KINDS = dict(DATA)
KINDS["nonfinite"] = lambda b: torch.cat([torch.randn(b), torch.tensor([float("nan")] * 3), torch.randn(b),
                                          torch.tensor([float("inf")]), torch.randn(b), torch.tensor([-float("inf")]),
                                          torch.randn(b), torch.tensor([float("inf"), -float("inf")])])


INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture(params=["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch) -> str:
    """``cpu`` under Triton's interpreter, or ``cuda`` compiled (tests/conftest.py sets ``TRITON_INTERPRET=1``
    without CUDA, before Triton loads: Triton reads it once)."""
    if request.param == "interpreter":
        if not INTERPRETING:
            pytest.skip("Triton was loaded compiled (CUDA is visible): the interpreter runs where it is not")
        return "cpu"
    if not torch.cuda.is_available() or INTERPRETING:
        pytest.skip("needs CUDA, and Triton loaded compiled")
    monkeypatch.delenv("BAGUA_FUSED_CODECS", raising=False)
    return "cuda"


def assert_same_bits(got: torch.Tensor, expected: torch.Tensor) -> None:
    got, expected = got.cpu(), expected.cpu()
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan), "NaN in different places"
    differ = (got.view(torch.int32) != expected.view(torch.int32)) & ~nan
    assert int(differ.sum()) == 0, (f"{int(differ.sum())} of {got.numel()} values differ, first at "
                                    f"{differ.nonzero()[:3].view(-1).tolist()}")


@pytest.mark.parametrize("block", [64, bc.DEFAULT_BLOCK])
@pytest.mark.parametrize("codec", ["uint8", "uint4"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_block_kernels_write_the_cpu_bytes_and_values(kind, codec, block, device):
    torch.manual_seed(sorted(KINDS).index(kind))
    x = KINDS[kind](block)
    n = x.numel()
    wire = bc.encode(x, codec, block)
    out = torch.full_like(wire, 77, device=device)
    tk.block_encode(x.to(device), codec, block, out)
    assert torch.equal(out.cpu(), wire), f"{int((out.cpu() != wire).sum())} wire bytes differ"

    decoded = torch.empty(n, device=device)
    tk.block_decode(wire.to(device), n, codec, block, decoded, accumulate=False)
    assert_same_bits(decoded, bc.decode(wire, n, codec, block))

    base = torch.randn(n)
    expected = bc.decode(wire, n, codec, block, out=base.clone(), accumulate=True)
    summed = base.to(device)
    tk.block_decode(wire.to(device), n, codec, block, summed, accumulate=True)
    assert_same_bits(summed, expected)


def test_block_header_of_a_misaligned_wire(device):
    """A wire that starts off a 4-byte boundary (a slice of a larger buffer) gets the same bytes."""
    x = torch.randn(1000)
    wire = bc.encode(x, "uint4", 64)
    buf = torch.zeros(wire.numel() + 1, dtype=torch.uint8, device=device)
    tk.block_encode(x.to(device), "uint4", 64, buf[1:])
    assert torch.equal(buf[1:].cpu(), wire)
    y = torch.empty(1000, device=device)
    tk.block_decode(buf[1:], 1000, "uint4", 64, y, accumulate=False)
    assert_same_bits(y, bc.decode(wire, 1000, "uint4", 64))


def _chunk_rows(length: int = 5000) -> torch.Tensor:
    """The CUDA test's rows (ordinary, constant, offset far beyond their range, huge, tiny), random ones, and
    signed zeros."""
    gen = torch.Generator().manual_seed(51)
    rows = _rows()[:, :length]  # each row's kind holds on any slice; the interpreter runs a program in ~1 ms
    zeros = torch.zeros(rows.shape[1])
    zeros[::3] = -0.0  # zeros of both signs: the header's zero is +0 on every device
    return torch.cat([rows, torch.randn(3, rows.shape[1], generator=gen) * 4 - 1, zeros.view(1, -1)])


def test_minmax_uint8_kernels_write_the_cpu_bytes_and_values(device):
    x = _chunk_rows()
    n, length = x.shape
    wire = mm.wire_buffer(n, length)
    mm.encode_chunks(x, wire)
    minmax = tk.chunks_minmax(x.to(device))
    assert torch.equal(minmax.cpu(), mm.chunk_minmax(x))
    got = torch.empty_like(wire, device=device)
    tk.chunks_encode(x.to(device), got, minmax)
    assert torch.equal(got.cpu(), wire), f"{int((got.cpu() != wire).sum())} wire bytes differ"

    expected = torch.empty(n, length)
    mm.decode_chunks(wire, expected)
    decoded = torch.empty(n, length, device=device)
    tk.chunks_decode(wire.to(device), decoded, accumulate=False)
    assert_same_bits(decoded, expected)

    base = torch.randn(n, length)
    expected = base.clone()
    mm.decode_chunks(wire, expected, accumulate=True)
    summed = base.to(device)
    tk.chunks_decode(wire.to(device), summed, accumulate=True)
    assert_same_bits(summed, expected)

    expected = torch.empty(length)
    mm.decode_sum_chunks(wire[:5], expected)
    total = torch.empty(length, device=device)
    tk.chunks_decode_sum(wire[:5].to(device), total)
    assert_same_bits(total, expected)


def test_minmax_uint8_segments_of_column_slices(device):
    """Column slices of chunks encoded with the whole chunks' parameters (how the scatter-reduce sends a chunk in
    segments): rows of a stride other than their length."""
    x = _chunk_rows()[:, :3000]
    params = mm.ChunkParams(mm.chunk_minmax(x))
    a, b = 1000, 2500
    wire = mm.wire_buffer(x.shape[0], b - a)
    mm.encode_chunks(x[:, a:b], wire, params=params)
    got = torch.empty_like(wire, device=device)
    tk.chunks_encode(x.to(device)[:, a:b], got, params.minmax.to(device))
    assert torch.equal(got.cpu(), wire)
    expected = torch.zeros(x.shape[0], 3000)
    mm.decode_chunks(wire, expected[:, a:b], params=params)
    decoded = torch.zeros(x.shape[0], 3000, device=device)
    tk.chunks_decode(wire.to(device), decoded[:, a:b], accumulate=False, minmax=params.minmax.to(device))
    assert_same_bits(decoded, expected)


def test_minmax_uint8_codes_of_pieces(device):
    """Gradients in separate tensors encoded with their chunk's parameters, codes only (ByteGrad's buckets)."""
    x = _chunk_rows()[2:4, :3000]
    params = mm.ChunkParams(mm.chunk_minmax(x))
    pieces = [x[1, :700], x[1, 700:701], x[1, 701:]]
    expected = torch.empty(3000, dtype=torch.uint8)
    mm.encode_pieces(pieces, expected, params, 1, None)
    got = torch.full((3000,), 7, dtype=torch.uint8, device=device)
    offset = 0
    for piece in pieces:
        tk.chunks_encode(piece.to(device).view(1, -1), got[offset : offset + piece.numel()].view(1, -1),
                         params.minmax[1:2].to(device), header=False)
        offset += piece.numel()
    assert torch.equal(got.cpu(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING, reason="needs CUDA, and Triton loaded compiled")
def test_codecs_take_the_kernels_on_cuda_and_match_the_eager_path(monkeypatch):
    """The public functions on CUDA tensors: the kernels by default, the whole-tensor path with
    ``BAGUA_FUSED_CODECS=0``; both equal the CPU's bytes."""
    x = torch.randn(3 * bc.DEFAULT_BLOCK + 5)
    for codec in ("uint8", "uint4"):
        wire = bc.encode(x, codec)
        for flag in ("1", "0"):
            monkeypatch.setenv("BAGUA_FUSED_CODECS", flag)
            assert tk.enabled(x.cuda()) == (flag == "1")
            assert torch.equal(bc.encode(x.cuda(), codec).cpu(), wire)
    rows = _chunk_rows()
    wire = mm.wire_buffer(*rows.shape)
    mm.encode_chunks(rows, wire)
    monkeypatch.setenv("BAGUA_FUSED_CODECS", "1")
    got = mm.wire_buffer(*rows.shape, device="cuda")
    mm.encode_chunks(rows.cuda(), got)
    assert torch.equal(got.cpu(), wire)
