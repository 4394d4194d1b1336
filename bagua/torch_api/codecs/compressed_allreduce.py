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
:mod:`bagua.torch_api.algorithms.bytegrad`.
:func:`~bagua.torch_api.ops.compressed.centralized_low_precision_op`, the bucket operation, runs this
collective (``codec="chunk"``) or the block-wise one of :mod:`bagua.torch_api.codecs.block_allreduce` (``"uint8"``,
``"uint4"``).

Example:
    >>> c = bagua.communication._get_default_group().get_global_communicator()  # doctest: +SKIP
    >>> low_precision_allreduce_inplace(torch.randn(1000), c)  # doctest: +SKIP
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Callable, Optional

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

if TYPE_CHECKING:  # bucket.py imports this module through compressed_bucket_op
    from bagua.torch_api.bucket import BaguaBucket

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


def _post_receives_first(group) -> bool:
    """Whether step 2 posts every receive before its first send (gloo), or sends and receives each segment as one
    group (NCCL and others).

    A gloo send waits for the receiver's "ready" message; posted late, that message queues behind the receiver's
    own outgoing data and the exchange runs at half the link's rate. NCCL runs a pair's operations in order on
    one stream, so a receive posted ahead of the matching send would block it: there each segment's sends and
    receives go together through ``batch_isend_irecv``.
    """
    return dist.get_backend(group) == "gloo"


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
    soon as the min/max of the chunks that travel are known, and the rank's own chunk is encoded (and its min/max
    read) while the wire is busy.

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
    n, r = c.nranks(), c.rank()
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
    own = chunks[r]

    # 1-2: the chunks of the peers first, each segment sent as soon as it is encoded; the rank's own chunk
    # (which never travels) is encoded while they are on the wire
    if ws.residual is not None:
        ws.previous[0].copy_(ws.residual)
        ws.previous[1].copy_(ws.server_residual)
        chunks.add_(ws.residual)
    L = ws.length
    peers = [(r + d) % n for d in range(1, n)]

    def row_params(j: int) -> ChunkParams:
        # one header for all the segments of a chunk
        mm = chunk_minmax(chunks[j : j + 1])[0] if source is None else pieces_minmax(source(j * L, (j + 1) * L))
        return ChunkParams(mm.view(1, 2))

    def encode_row(j: int, k: int, p: ChunkParams) -> None:
        a, b = ws.segments[k]
        wire = ws.send[k][j : j + 1]
        if source is None:
            encode_chunks(chunks[j : j + 1, a:b], wire, ws.work, params=p)
        else:
            wire[:, :HEADER_BYTES].copy_(p.header)
            encode_pieces(source(j * L + a, j * L + b), wire[0, HEADER_BYTES:], p, 0, ws.work)

    receives_first = _post_receives_first(c.group)
    handles: list[list] = [
        [dist.irecv(ws.recv[k][j], c.global_rank(j), group=c.group, tag=tag) for j in peers] if receives_first else []
        for k in range(len(ws.segments))
    ]
    params = {j: row_params(j) for j in peers}
    for k in range(len(ws.segments)):
        for j in peers:
            encode_row(j, k, params[j])
        if receives_first:
            handles[k] += [dist.isend(ws.send[k][j], c.global_rank(j), group=c.group, tag=tag) for j in peers]
        else:  # each segment's sends and receives in one group, in the same order on every rank
            ops = [dist.P2POp(dist.isend, ws.send[k][j], c.global_rank(j), c.group, tag) for j in peers]
            ops += [dist.P2POp(dist.irecv, ws.recv[k][j], c.global_rank(j), c.group, tag) for j in peers]
            handles[k] += dist.batch_isend_irecv(ops)
    params[r] = row_params(r)
    for k in range(len(ws.segments)):
        encode_row(r, k, params[r])
        ws.recv[k][r].copy_(ws.send[k][r])
    if ws.residual is not None:  # e = x - D(Q(x)), while the segments travel
        every = ChunkParams(torch.cat([params[j].minmax for j in range(n)]))
        for k, (a, b) in enumerate(ws.segments):
            residual = ws.residual[:, a:b]
            decode_chunks(ws.send[k], residual, params=every)
            torch.sub(chunks[:, a:b], residual, out=residual)

    # 3: decode the n copies of chunk r and add them in rank order; each segment is averaged and its min/max
    # taken while it is still in cache, as the next segments arrive
    bounds = []
    received = None  # every segment of a chunk carries the chunk's header: read the headers once
    for k, (a, b) in enumerate(ws.segments):
        for work in handles[k]:
            work.wait()
        segment = own[a:b]
        received = received or ChunkParams.of_wire(ws.recv[k])
        decode_sum_chunks(ws.recv[k], segment, ws.work, params=received)
        if average:
            segment.div_(n)
        if ws.server_residual is not None:
            segment.add_(ws.server_residual[a:b])
        if b > a:
            bounds.append(torch.aminmax(segment))

    # 4: encode chunk r, all-gather it segment by segment
    own_params = ChunkParams(merge_minmax(bounds).view(1, 2) if bounds else chunk_minmax(own.view(1, -1)))
    handles = []
    for k, (a, b) in enumerate(ws.segments):
        encode_chunks(own[a:b].view(1, -1), ws.mine[k], ws.work, params=own_params)
        handles.append(_all_gather_single(ws.recv[k].view(-1), ws.mine[k].view(-1), group=c.group, async_op=True))
        if ws.server_residual is not None:  # s = y - D(Q(y))
            residual = ws.server_residual[a:b].view(1, -1)
            decode_chunks(ws.mine[k], residual, params=own_params)
            torch.sub(own[a:b].view(1, -1), residual, out=residual)

    # 5: decode every chunk
    gathered = None
    for k, (a, b) in enumerate(ws.segments):
        handles[k].wait()
        gathered = gathered or ChunkParams.of_wire(ws.recv[k])
        decode_chunks(ws.recv[k], chunks[:, a:b], params=gathered)
    if ws.staging is not None:
        flat.view(-1).copy_(x[: ws.numel])
    return (gathered is not None and gathered.decodes_finite()) or all_finite(flat)


def bucket_tag(bucket: BaguaBucket, group: Optional[BaguaProcessGroup] = None) -> int:
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
