"""The 8-bit compressed allreduce (MinMaxUInt8 around a scatter-reduce-gather), a collective of its own.

ByteGrad and QAdam's compressed stage are built from it, and a bucket reaches it through
``BaguaBucket.append_centralized_synchronous_op(compression="MinMaxUInt8")``; it knows no algorithm. The steps,
with ``n`` ranks in the communicator, for rank ``r`` (the input is padded with zeros to a multiple of ``n``, so it
splits into ``n`` equal chunks):

1. split the flat tensor into ``n`` chunks and encode each with its own min/max
   (:mod:`bagua.torch_api.codecs.minmax_uint8`);
2. all-to-all, point to point: rank ``r`` receives every rank's encoded chunk ``r`` (its own never travels);
3. decode them and add them in rank order in float32, then divide by ``n`` (``average=True``);
4. encode the reduced chunk ``r`` and all-gather the encoded chunks;
5. decode all ``n`` chunks.

Every element is quantized twice, and every rank ends with the same bytes. Error feedback: see
:mod:`bagua.torch_api.algorithms.bytegrad`. The schedule (which send and receive goes when) is the one
:func:`~bagua.torch_api.codecs.scatter_reduce_gather.scatter_reduce_gather` runs for both 8-bit collectives; this
module gives it the codec (:class:`_ChunkCodec`).
:func:`~bagua.torch_api.ops.compressed.centralized_low_precision_op`, the bucket operation, runs this
collective (``codec="chunk"``) or the block-wise one of :mod:`bagua.torch_api.codecs.block_allreduce` (``"uint8"``,
``"uint4"``).

Example:
    >>> c = bagua.communication._get_default_group().get_global_communicator()  # doctest: +SKIP
    >>> low_precision_allreduce_inplace(torch.randn(1000), c)  # doctest: +SKIP
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.codecs.minmax_uint8 import (
    HEADER_BYTES,
    ChunkParams,
    chunk_minmax,
    decode_chunks,
    decode_sum_chunks,
    encode_chunks,
    encode_pieces,
    merge_minmax,
    pieces_minmax,
    scratch_buffer,
    wire_buffer,
)
from bagua.torch_api.comm.process_group import BaguaCommunicator, BaguaProcessGroup
from bagua.torch_api.codecs.residuals import ErrorFeedbackResiduals
from bagua.torch_api.codecs.scatter_reduce_gather import SegmentCodec, Wait, scatter_reduce_gather
from bagua.torch_api.codecs.scatter_reduce_gather import post_receives_first as _post_receives_first
from bagua.torch_api.interfaces import Bucket

__all__ = [
    "SEGMENT",
    "Workspace",
    "low_precision_allreduce_inplace",
    "bucket_tag",
    "all_finite",
]


#: Elements of a chunk sent per collective; larger chunks are sent in several pipelined segments.
SEGMENT = 1 << 18

# torch >= 2.7 names it all_gather_single and deprecates all_gather_into_tensor (a FutureWarning per call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Workspace(ErrorFeedbackResiduals):
    """The buffers of one bucket's compressed allreduce, allocated once and reused every step.

    Args:
        numel: elements of the flat bucket.
        nranks: ranks of the communicator (the bucket splits into that many chunks).
        device: the bucket's device.
        error_feedback: keep the error-feedback residuals.

    A float32 staging copy of the bucket is added when its size is not a multiple of ``nranks`` or, at the first
    call, when its dtype is not float32.
    """

    __slots__ = (
        "numel", "nranks", "length", "segments", "send", "recv", "mine", "work", "staging", "residual",
        "server_residual", "previous",
    )

    def __init__(self, numel: int, nranks: int, device: torch.device, error_feedback: bool = False) -> None:
        # shape
        self.numel = numel
        self.nranks = nranks
        self.length = -(-numel // nranks)
        self.segments = [(a, min(a + SEGMENT, self.length)) for a in range(0, self.length, SEGMENT)] or [(0, 0)]
        # wire buffers, one set per segment (recv is reused as the all-gather output)
        self.send = [wire_buffer(nranks, b - a, device) for a, b in self.segments]
        self.recv = [wire_buffer(nranks, b - a, device) for a, b in self.segments]
        self.mine = [wire_buffer(1, b - a, device) for a, b in self.segments]
        # float buffers
        self.work = scratch_buffer(min(self.length, SEGMENT), device)
        self.staging = self._new_staging(device) if nranks * self.length != numel else None
        self.residual = torch.zeros(nranks, self.length, device=device) if error_feedback else None
        self.server_residual = torch.zeros(self.length, device=device) if error_feedback else None
        # the residuals before the last call, so that a step whose result is not finite can be undone
        self.previous = (torch.zeros_like(self.residual), torch.zeros_like(self.server_residual)) if (
            error_feedback) else None

    def _new_staging(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.nranks * self.length, dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        """The device of the buffers."""
        return self.send[0].device

    def bytes_sent(self) -> int:
        """Return the bytes a rank sends in one call: its n-1 peers' encoded chunks, then its own chunk to each of
        them (each segment with the chunk's header).

        Example:
            >>> Workspace(1000, 2, torch.device("cpu")).bytes_sent()  # 2 * (500 + 8)
            1016
        """
        return 2 * (self.nranks - 1) * (self.length + HEADER_BYTES * len(self.segments))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy the residuals of :meth:`state_dict` into this workspace's (an empty dict zeroes them).

        Raises:
            ValueError: the workspace keeps no residuals, or the shapes differ (another bucket, codec or rank count).
        """
        if self.residual is None:
            raise ValueError("this workspace was built without error feedback: it has no residuals to load")
        if not state:
            self.residual.zero_()
            self.server_residual.zero_()
            return
        if state["residual"].shape != self.residual.shape:
            raise ValueError(f"error-feedback residuals of shape {tuple(state['residual'].shape)} cannot be "
                             f"loaded into a bucket of shape {tuple(self.residual.shape)}; the checkpoint was "
                             "saved with other buckets, another codec or another number of ranks")
        self.residual.copy_(state["residual"])
        self.server_residual.copy_(state["server_residual"])

    def allreduce_inplace(self, flat: torch.Tensor, c: BaguaCommunicator, *, average: bool = True,
                          error_feedback: bool = False, tag: int = 0,
                          source: Optional[Callable[[int, int], list[torch.Tensor]]] = None) -> Optional[bool]:
        """Run :func:`low_precision_allreduce_inplace` on ``flat`` with this workspace; return its finite verdict.

        ``error_feedback`` must agree with how the workspace was built (it allocates its residuals up front).
        """
        if error_feedback != (self.residual is not None):
            raise ValueError(f"error_feedback={error_feedback}, but the workspace was built with"
                             f"{'' if self.residual is not None else 'out'} error feedback")
        return low_precision_allreduce_inplace(flat, c, average, self, source=source, tag=tag)


class _ChunkCodec(SegmentCodec):
    """MinMaxUInt8 with one header per rank chunk, for :func:`scatter_reduce_gather`: the chunks are the rows of
    ``chunks`` (``(n, L)``), sent in the workspace's segments, every segment of a chunk with the chunk's header."""

    def __init__(self, ws: Workspace, chunks: torch.Tensor, rank: int, average: bool,
                 source: Optional[Callable[[int, int], list[torch.Tensor]]]) -> None:
        self.ws, self.chunks, self.rank, self.average, self.source = ws, chunks, rank, average, source
        self.own = chunks[rank]
        self.segments = len(ws.segments)
        self.params: dict[int, ChunkParams] = {}
        self.received: Optional[ChunkParams] = None  # the headers of the copies of chunk r, read once
        self.bounds: list[tuple[torch.Tensor, torch.Tensor]] = []  # min/max of each reduced segment
        self.own_params: Optional[ChunkParams] = None
        self.gathered: Optional[ChunkParams] = None

    def send_buffer(self, k: int, j: int) -> torch.Tensor:
        return self.ws.send[k][j]

    def recv_buffer(self, k: int, i: int) -> torch.Tensor:
        return self.ws.recv[k][i]

    def _encode_row(self, k: int, j: int) -> None:
        if k == 0:  # one header for all the segments of a chunk
            L = self.ws.length
            mm = (chunk_minmax(self.chunks[j : j + 1])[0] if self.source is None
                  else pieces_minmax(self.source(j * L, (j + 1) * L)))
            self.params[j] = ChunkParams(mm.view(1, 2))
        a, b = self.ws.segments[k]
        wire, p = self.ws.send[k][j : j + 1], self.params[j]
        if self.source is None:
            encode_chunks(self.chunks[j : j + 1, a:b], wire, self.ws.work, params=p)
        else:
            wire[:, :HEADER_BYTES].copy_(p.header)
            encode_pieces(self.source(j * self.ws.length + a, j * self.ws.length + b), wire[0, HEADER_BYTES:], p, 0,
                          self.ws.work)

    def encode_peer(self, k: int, j: int) -> None:
        self._encode_row(k, j)

    def encode_own(self, k: int) -> None:
        self._encode_row(k, self.rank)
        self.ws.recv[k][self.rank].copy_(self.ws.send[k][self.rank])

    def keep_residuals(self) -> None:
        ws = self.ws
        if ws.residual is None:
            return
        every = ChunkParams(torch.cat([self.params[j].minmax for j in range(ws.nranks)]))
        for k, (a, b) in enumerate(ws.segments):  # e = x - D(Q(x)), while the segments travel
            residual = ws.residual[:, a:b]
            decode_chunks(ws.send[k], residual, params=every)
            torch.sub(self.chunks[:, a:b], residual, out=residual)

    def reduce(self, k: int, wait: Wait) -> None:
        # the n copies decoded and added in rank order; the segment averaged and its min/max taken while it is
        # still in cache, as the next segments arrive
        ws = self.ws
        for i in range(ws.nranks):
            wait(i)
        a, b = ws.segments[k]
        segment = self.own[a:b]
        self.received = self.received or ChunkParams.of_wire(ws.recv[k])
        decode_sum_chunks(ws.recv[k], segment, ws.work, params=self.received)
        if self.average:
            segment.div_(ws.nranks)
        if ws.server_residual is not None:
            segment.add_(ws.server_residual[a:b])
        if b > a:
            self.bounds.append(torch.aminmax(segment))

    def encode_reduced(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ws, own = self.ws, self.own
        if k == 0:
            self.own_params = ChunkParams(merge_minmax(self.bounds).view(1, 2) if self.bounds
                                          else chunk_minmax(own.view(1, -1)))
        a, b = ws.segments[k]
        encode_chunks(own[a:b].view(1, -1), ws.mine[k], ws.work, params=self.own_params)
        return ws.recv[k], ws.mine[k]

    def keep_server_residual(self, k: int) -> None:
        if self.ws.server_residual is not None:  # s = y - D(Q(y))
            a, b = self.ws.segments[k]
            residual = self.ws.server_residual[a:b].view(1, -1)
            decode_chunks(self.ws.mine[k], residual, params=self.own_params)
            torch.sub(self.own[a:b].view(1, -1), residual, out=residual)

    def decode_gathered(self, k: int) -> None:
        a, b = self.ws.segments[k]
        self.gathered = self.gathered or ChunkParams.of_wire(self.ws.recv[k])
        decode_chunks(self.ws.recv[k], self.chunks[:, a:b], params=self.gathered)


def low_precision_allreduce_inplace(
    flat: torch.Tensor,
    c: BaguaCommunicator,
    average: bool = True,
    workspace: Optional[Workspace] = None,
    source: Optional[Callable[[int, int], list[torch.Tensor]]] = None,
    tag: int = 0,
) -> Optional[bool]:
    """Average (or sum) ``flat`` over the communicator ``c`` in 8 bits: steps 1-5 of the module docstring.

    Step 2 sends each chunk to its owner point to point, the peers' chunks first: the first segment leaves as
    soon as its chunk's min/max is known, and the rank's own chunk is encoded (and its min/max read) while the
    wire is busy. The schedule is :func:`~bagua.torch_api.codecs.scatter_reduce_gather.scatter_reduce_gather`'s.

    Args:
        flat: a 1-D float tensor, the same size on every rank; overwritten with the result.
        c: the communicator; a non-member or a one-rank communicator leaves ``flat`` unchanged (exact).
        average: divide the sum by the number of ranks.
        workspace: buffers from a previous call (with the residuals of error feedback); a new one otherwise.
        source: where to read the input instead of ``flat``: ``source(start, end)`` returns the values of the
            range ``[start, end)`` as 1-D float32 pieces (:meth:`BaguaBucket.pieces`, gradients not yet copied into
            the bucket). ``flat`` then only receives the result. Not with error feedback, padding or float16.
        tag: the point-to-point tag of step 2 (calls in flight at the same time on one group need different tags).

    Returns:
        Whether every value written to ``flat`` is finite, read from the chunks' headers (an exact element-wise
        test only when a header is not finite); ``None`` when nothing was communicated.

    Example:
        >>> c = bagua.communication._get_default_group().get_global_communicator()  # doctest: +SKIP
        >>> low_precision_allreduce_inplace(torch.randn(1000), c)  # doctest: +SKIP
    """
    if c.group is None or c.nranks() == 1:
        return None
    c.check_point_to_point(flat, "the 8-bit scatter-reduce (ByteGrad, QAdam)")
    n = c.nranks()
    ws = workspace or Workspace(flat.numel(), n, flat.device)
    if ws.numel != flat.numel() or ws.nranks != n:
        raise ValueError(f"workspace was built for {ws.numel} elements on {ws.nranks} ranks, got {flat.numel()} / {n}")
    if ws.staging is None and flat.dtype != torch.float32:
        ws.staging = ws._new_staging(flat.device)
    if source is not None and (ws.staging is not None or ws.residual is not None):
        raise ValueError("source= needs a float32 input without padding and without error feedback")
    x = flat.view(-1)
    if ws.staging is not None:
        ws.staging[: ws.numel].copy_(x)
        ws.staging[ws.numel :].zero_()
        x = ws.staging
    chunks = x.view(n, ws.length)
    if ws.residual is not None:
        ws.previous[0].copy_(ws.residual)
        ws.previous[1].copy_(ws.server_residual)
        chunks.add_(ws.residual)
    codec = _ChunkCodec(ws, chunks, c.rank(), average, source)
    # this module's names, looked up now: tests and benchmarks/bytegrad_timeline.py wrap them here
    scatter_reduce_gather(codec, c, tag, _post_receives_first(c.group), dist, _all_gather_single)
    if ws.staging is not None:
        flat.view(-1).copy_(x[: ws.numel])
    gathered = codec.gathered
    return (gathered is not None and gathered.decodes_finite()) or all_finite(flat)


def bucket_tag(bucket: Bucket, group: Optional[BaguaProcessGroup] = None) -> int:
    """A point-to-point tag of the bucket in ``group``, the same on every rank (groups and buckets are named alike
    everywhere): the group's name (an engine's private group is named after the engine) and the bucket's."""
    key = f"{group.group_name if group is not None else ''}/{bucket.name}"
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, in one read-only pass when it is.

    The float32 sum of finite values is finite unless it overflows, and a NaN or Inf anywhere makes the sum
    NaN or Inf; so a finite sum proves the tensor finite, and only a non-finite sum pays for the exact
    element-wise test (``torch.isfinite(t).all()`` allocates a mask and costs about 15x a sum on CPU).

    Example:
        >>> all_finite(torch.tensor([1.0, 2.0])), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
    """
    if not t.is_floating_point():
        return True
    total = t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()
    return bool(torch.isfinite(total)) or bool(torch.isfinite(t).all())
