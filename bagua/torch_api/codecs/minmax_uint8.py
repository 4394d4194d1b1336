"""MinMaxUInt8: the 8-bit codec of ByteGrad, QAdam and low-precision decentralized SGD, as pure tensor functions.

Per chunk, with ``eps = 1e-7`` (all in float32)::

    scale = 255 / (max - min + eps);  upper = round(max * scale);  lower = upper - 255
    encode: q = uint8(min(round(x * scale), upper) - lower)
    decode: x' = (q + lower) / scale

so ``|x - x'| <= (max - min + eps) / 510`` (half a quantization step) up to float32 rounding. The wire format of
``n`` chunks of ``L`` elements is one ``uint8`` tensor of shape ``(n, 8 + L)``: each row starts with the chunk's
min and max as two float32 (8 bytes), followed by its ``L`` codes, so a whole bucket travels in a single
collective.

Speed: on CPU every function works row by row with the row's ``scale`` and ``lower`` as Python scalars and
streams the row through a small scratch block (:data:`BLOCK` elements), so each element is read once from
memory and written once; the passes (multiply, round, shift, clamp, casts) run in cache. The result is
bit-identical to the whole-tensor formulas above, which other devices use. ``clamp(round(x*scale) - lower, 0,
255)`` is how the encoder writes ``min(round(x*scale), upper) - lower``: the two are equal (``upper - lower =
255`` exactly) and the clamp also keeps the ``uint8`` cast defined for chunks whose range is tiny compared with
their magnitude, where float32 cannot hold ``x*scale`` to the unit.

Example:
    >>> x = torch.randn(2, 1000)
    >>> wire = wire_buffer(2, 1000)
    >>> encode_chunks(x, wire)
    >>> y = torch.empty_like(x); decode_chunks(wire, y)
    >>> bool(((x - y).abs() <= quantization_error_bound(x)[:, None] + 1e-6).all())
    True
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from bagua.torch_api.codecs import codec_format, triton_kernels
from bagua.torch_api.codecs.codec_format import (  # noqa: F401 (the format's public names are this module's too)
    _MAGIC,
    EPS,
    HEADER_BYTES,
    ChunkParams,
    _check_wire,
    quantization_error_bound,
    wire_buffer,
)

__all__ = [
    *codec_format.__all__,
    "BLOCK",
    "scratch_buffer",
    "chunk_minmax",
    "encode_chunks",
    "decode_chunks",
    "decode_sum_chunks",
    "encode_pieces",
    "merge_minmax",
    "pieces_minmax",
]

#: Elements per cache block on CPU (1 MiB of float32: fits the L2/L3 of current x86 cores).
BLOCK = 1 << 18


def scratch_buffer(chunk_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Allocate a float32 scratch buffer large enough for every function of this module on ``device``.

    On CPU that is two blocks (of :data:`BLOCK` elements at most); on other devices a whole chunk row.

    Example:
        >>> scratch_buffer(10).numel()
        20
    """
    n = 2 * min(chunk_len, BLOCK) if torch.device(device).type == "cpu" else chunk_len
    return torch.empty(max(n, 1), dtype=torch.float32, device=device)


def _scratch(work: Optional[torch.Tensor], numel: int, device: torch.device) -> torch.Tensor:
    if work is not None and work.dtype == torch.float32 and work.is_contiguous() and work.numel() >= numel:
        return work.view(-1)[:numel]
    return torch.empty(numel, dtype=torch.float32, device=device)


def _blocked(x: torch.Tensor) -> bool:
    return x.device.type == "cpu"


def _fused(values: torch.Tensor, wire: torch.Tensor) -> bool:
    """Whether to run the Triton kernels: CUDA float32 rows of unit stride (``triton_kernels.enabled``)."""
    return (triton_kernels.enabled(values) and values.dtype == torch.float32 and values.stride(-1) == 1
            and wire.stride(-1) == 1)


def chunk_minmax(x: torch.Tensor) -> torch.Tensor:
    """The ``(n, 2)`` float32 min and max of every row of ``x`` (the header of each encoded chunk).

    Example:
        >>> chunk_minmax(torch.tensor([[1.0, -2.0, 3.0]]))
        tensor([[-2.,  3.]])
    """
    xf = x if x.dtype == torch.float32 else x.float()
    length = xf.shape[1]
    if not _blocked(xf) or length <= BLOCK:
        return torch.stack((xf.amin(dim=1), xf.amax(dim=1)), dim=1)
    # block by block, one pass each: a full aminmax of a cached block costs about 0.7x amin then amax (but
    # aminmax with dim= or out= takes a path about 10x slower, so the per-block results are stacked instead)
    return torch.stack([pieces_minmax([row]) for row in xf])


def encode_chunks(
    x: torch.Tensor,
    wire: torch.Tensor,
    work: Optional[torch.Tensor] = None,
    minmax: Optional[torch.Tensor] = None,
    params: Optional[ChunkParams] = None,
) -> None:
    """Encode the rows of ``x`` (``(n, L)``, float) into ``wire`` (``(n, 8 + L)``, uint8).

    Args:
        x: the chunks, one per row (any float dtype; computed in float32). It is not modified.
        wire: output buffer from :func:`wire_buffer`.
        work: optional float32 scratch from :func:`scratch_buffer` (must not share memory with ``x``), to avoid
            an allocation per call.
        minmax: optional ``(n, 2)`` float32 per-row min/max to use instead of ``x``'s own (see
            :func:`chunk_minmax`): encoding the column slices ``x[:, a:b]`` of chunks with the whole chunks'
            min/max gives segments whose codes are those of the whole chunks, so a chunk can be sent in pieces.
        params: the same, prepared once for all segments (:class:`ChunkParams`); takes precedence over ``minmax``.

    Example:
        >>> wire = wire_buffer(1, 3); encode_chunks(torch.tensor([[0.0, 0.5, 1.0]]), wire)
        >>> wire[0, 8:].tolist()
        [0, 127, 255]
    """
    n, length = x.shape
    _check_wire(wire, n, length)
    if length == 0:
        wire.zero_()
        return
    xf = x if x.dtype == torch.float32 else x.float()
    if _fused(xf, wire):  # CUDA: Triton kernels, the same bytes (triton_kernels), no wait for the host
        mm = params.minmax if params is not None else minmax
        mm = triton_kernels.chunks_minmax(xf) if mm is None else mm.detach().to(xf.device, torch.float32)
        triton_kernels.chunks_encode(xf, wire, mm.contiguous())
        return
    if params is None:
        params = ChunkParams(chunk_minmax(xf) if minmax is None else minmax)
    wire[:, :HEADER_BYTES].copy_(params.header)
    codes = wire[:, HEADER_BYTES:]
    if _blocked(xf):
        buf = _scratch(work, 2 * min(length, BLOCK), xf.device)
        for i, (row, out) in enumerate(zip(xf, codes)):
            _encode_blocked(row, out, params, i, buf)
    else:
        _encode_whole(xf, codes, params.scale, params.lower, _scratch(work, n * length, xf.device).view(n, length))


def _encode_whole(
    x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, lower: torch.Tensor, w: torch.Tensor
) -> None:
    """The encoding formula as whole-tensor operations (devices other than CPU); ``w``: float32 scratch like ``x``."""
    torch.mul(x, scale, out=w)
    w.round_().sub_(lower).clamp_(0.0, 255.0)
    out.copy_(w)


def _encode_blocked(x: torch.Tensor, out: torch.Tensor, params: ChunkParams, row: int, buf: torch.Tensor) -> None:
    """Encode the 1-D float32 ``x`` (part of chunk ``row``) into the 1-D uint8 ``out``, a cache block at a time
    (``buf``: float32 scratch of at least ``2 * min(len(x), BLOCK)`` elements)."""
    length = x.numel()
    block = min(length, BLOCK)
    as_int = buf[block : 2 * block].view(torch.int32)
    s, lo, fast = params.scales[row], params.lowers[row], params.fast[row]
    for a in range(0, length, BLOCK):
        b = min(a + BLOCK, length)
        w, wi = buf[: b - a], as_int[: b - a]
        torch.mul(x[a:b], s, out=w)
        if fast:
            # round(x*scale) - lower + 2**23 is exact and lies in [2**23, 2**23 + 255]: the low byte of
            # its float32 bits is the code, and the int32 -> uint8 cast keeps exactly that byte
            w.round_().sub_(lo - _MAGIC)
            out[a:b].copy_(w.view(torch.int32))
            continue
        w.round_().sub_(lo).clamp_(0.0, 255.0)
        # float -> int32 -> uint8 is about twice as fast as torch's direct float -> uint8 cast
        wi.copy_(w)
        out[a:b].copy_(wi)


def pieces_minmax(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ``(2,)`` float32 min and max of the concatenation of the 1-D ``pieces`` (none may be empty).

    Example:
        >>> pieces_minmax([torch.tensor([1.0, 5.0]), torch.tensor([-2.0])])
        tensor([-2.,  5.])
    """
    return merge_minmax([torch.aminmax(p[a : a + BLOCK].float()) for p in pieces for a in range(0, p.numel(), BLOCK)])


def merge_minmax(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The ``(2,)`` float32 min and max over the ``(min, max)`` pairs of ``parts`` (e.g. ``torch.aminmax`` results
    of the blocks of a chunk); at least one part.

    Example:
        >>> merge_minmax([torch.aminmax(torch.tensor([1.0, 5.0])), torch.aminmax(torch.tensor([-2.0]))])
        tensor([-2.,  5.])
    """
    return torch.stack((torch.stack([p[0] for p in parts]).amin(), torch.stack([p[1] for p in parts]).amax()))


def encode_pieces(
    pieces: Sequence[torch.Tensor], codes: torch.Tensor, params: ChunkParams, row: int, work: Optional[torch.Tensor]
) -> None:
    """Encode the concatenation of the 1-D ``pieces`` into the 1-D uint8 ``codes`` (a slice of a wire row's codes)
    with the parameters of chunk ``row``: the same codes as :func:`encode_chunks` on the concatenated tensor,
    without building it (e.g. gradients that live in separate tensors).

    Example:
        >>> x = torch.randn(1, 6); wire = wire_buffer(1, 6); p = ChunkParams(chunk_minmax(x))
        >>> encode_chunks(x, wire, params=p)
        >>> codes = torch.empty(6, dtype=torch.uint8)
        >>> encode_pieces([x[0, :2], x[0, 2:]], codes, p, 0, None)
        >>> torch.equal(codes, wire[0, 8:])
        True
    """
    offset = 0
    for piece in pieces:
        out = codes[offset : offset + piece.numel()]
        offset += piece.numel()
        xf = piece if piece.dtype == torch.float32 else piece.float()
        if _fused(xf, out) and xf.numel():
            triton_kernels.chunks_encode(xf.view(1, -1), out.view(1, -1),
                                         params.minmax[row : row + 1].to(xf.device), header=False)
        elif _blocked(xf):
            _encode_blocked(xf, out, params, row, _scratch(work, 2 * min(xf.numel(), BLOCK), xf.device))
        else:
            _encode_whole(xf, out, params.scale[row], params.lower[row], _scratch(work, xf.numel(), xf.device))
    if offset != codes.numel():
        raise ValueError(f"the pieces hold {offset} elements but codes has {codes.numel()}")


def decode_chunks(
    wire: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool = False,
    work: Optional[torch.Tensor] = None,
    params: Optional[ChunkParams] = None,
) -> None:
    """Decode ``wire`` (``(n, 8 + L)``) into ``out`` (``(n, L)``); with ``accumulate``, add to ``out`` instead.

    Args:
        wire: encoded chunks.
        out: float output, one chunk per row.
        accumulate: add the decoded values to ``out`` instead of overwriting it.
        work: optional float32 scratch from :func:`scratch_buffer` (used with ``accumulate`` or a non-float32 ``out``).
        params: the chunks' parameters when already known (:class:`ChunkParams`, e.g. from an earlier segment of
            the same chunks); read from ``wire``'s headers otherwise.

    Example:
        >>> wire = wire_buffer(1, 3); encode_chunks(torch.tensor([[0.0, 0.5, 1.0]]), wire)
        >>> out = torch.empty(1, 3); decode_chunks(wire, out); out
        tensor([[0.0000, 0.4980, 1.0000]])
    """
    n, length = out.shape
    _check_wire(wire, n, length)
    if length == 0:
        return
    if _fused(out, wire):
        triton_kernels.chunks_decode(wire, out, accumulate, None if params is None else params.minmax.to(out.device))
        return
    params = params or ChunkParams.of_wire(wire)
    codes = wire[:, HEADER_BYTES:]
    direct = out.dtype == torch.float32 and not accumulate
    if _blocked(out):
        buf = None if direct else _scratch(work, min(length, BLOCK), out.device)
        for row, q, s, lo in zip(out, codes, params.scales, params.lowers):
            for a in range(0, length, BLOCK):
                b = min(a + BLOCK, length)
                w = row[a:b] if buf is None else buf[: b - a]
                w.copy_(q[a:b])
                w.add_(lo).div_(s)
                if accumulate:
                    row[a:b].add_(w)
                elif buf is not None:
                    row[a:b].copy_(w)
    else:
        w = out if direct else _scratch(work, n * length, out.device).view(n, length)
        w.copy_(codes)
        w.add_(params.lower).div_(params.scale)
        if accumulate:
            out.add_(w)
        elif not direct:
            out.copy_(w)


def decode_sum_chunks(
    wire: torch.Tensor, out: torch.Tensor, work: Optional[torch.Tensor] = None, params: Optional[ChunkParams] = None
) -> None:
    """Write into ``out`` (``(L,)``) the sum of the ``n`` decoded rows of ``wire``, added in row order.

    This is the reduce step of a scatter-reduce: ``out = ((d_0 + d_1) + d_2) + ...`` in float32, bit-identical
    to decoding every row and summing them one after the other.

    Args:
        wire: ``(n, 8 + L)`` encoded chunks (row ``i`` from rank ``i``).
        out: float output of ``L`` elements.
        work: optional float32 scratch from :func:`scratch_buffer`.
        params: the rows' parameters when already known (:class:`ChunkParams`); read from the headers otherwise.

    Example:
        >>> wire = wire_buffer(2, 2); encode_chunks(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), wire)
        >>> out = torch.empty(2); decode_sum_chunks(wire, out); out  # 1 + 0 within half a quantization step
        tensor([1.0000, 1.0000])
    """
    n = wire.shape[0]
    length = out.numel()
    _check_wire(wire, n, length)
    if length == 0:
        return
    flat_out = out.view(-1)
    if _fused(flat_out, wire):
        triton_kernels.chunks_decode_sum(wire, flat_out, None if params is None else params.minmax.to(out.device))
        return
    params = params or ChunkParams.of_wire(wire)
    scale, lower = params.scale, params.lower
    codes = wire[:, HEADER_BYTES:]
    direct = flat_out.dtype == torch.float32
    if _blocked(flat_out):
        scales, lowers = params.scales, params.lowers
        block = min(length, BLOCK)
        buf = _scratch(work, block if direct else 2 * block, flat_out.device)
        for a in range(0, length, BLOCK):
            b = min(a + BLOCK, length)
            acc = flat_out[a:b] if direct else buf[block : block + b - a]
            w = buf[: b - a]
            acc.copy_(codes[0, a:b])
            acc.add_(lowers[0]).div_(scales[0])
            for i in range(1, n):
                w.copy_(codes[i, a:b])
                w.add_(lowers[i])
                acc.addcdiv_(w, scale[i, 0])  # acc + (w / scale): the division and the sum, in one pass
            if not direct:
                flat_out[a:b].copy_(acc)
    else:
        buf = _scratch(work, length if direct else 2 * length, flat_out.device)
        acc = flat_out if direct else buf[length:]
        w = buf[:length]
        for i in range(n):
            target = acc if i == 0 else w
            target.copy_(codes[i])
            target.add_(lower[i]).div_(scale[i])
            if i > 0:
                acc.add_(w)
        if not direct:
            flat_out.copy_(acc)
