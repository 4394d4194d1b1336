"""ByteGrad: gradients averaged in 8 bits, MinMaxUInt8 around a scatter-reduce-gather allreduce.

Bagua paper: https://arxiv.org/abs/2107.01499. With ``n`` ranks in the communicator, rank ``r`` does, per bucket
(the bucket is padded with zeros to a multiple of the group size, so it splits into ``n`` equal chunks):

1. split the flat bucket into ``n`` chunks and encode each with its own min/max
   (:mod:`bagua.torch_api.compression`);
2. all-to-all, point to point: rank ``r`` receives every rank's encoded chunk ``r`` (its own never travels);
3. decode them and add them in rank order in float32, then divide by ``n`` (``average=True``);
4. encode the reduced chunk ``r`` and all-gather the encoded chunks;
5. decode all ``n`` chunks into the bucket.

Every element is therefore quantized twice, and every rank ends with the same bytes, hence the same gradient.
Each chunk travels as segments of at most :data:`SEGMENT` elements, each sent as soon as it is encoded (every
segment repeats its chunk's min/max header, so the codes are exactly those of the whole chunk): encoding, the
network and decoding overlap; the chunks that travel are encoded before the rank's own. Hierarchical (a group
spanning several nodes of several ranks): a float32 intra-node reduce (average) to each node's leader, the steps
above among the leaders, an intra-node broadcast.

Error feedback (``error_feedback=True``, after EF-SGD, https://arxiv.org/abs/1901.09847, and its two-sided
form DoubleSqueeze, https://arxiv.org/abs/1905.05957): each rank keeps ``e`` (one value per bucket element) and
each chunk owner keeps ``s`` (one per element of its chunk); with ``Q`` the encoding and ``D`` the decoding::

    x   = g + e                 e <- x - D(Q(x))       (the rank's own quantization error, step 1)
    y_r = mean_i D(Q(x_i))_r + s      s <- y_r - D(Q(y_r))  (the owner's error, step 4)
    result = D(Q(y))

so no part of a gradient is lost for good: what quantization drops in one step is sent in the next ones.

Example:
    >>> from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    >>> model = model.with_bagua([optimizer], ByteGradAlgorithm(error_feedback=True))  # doctest: +SKIP
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api import communication as comm
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.bucket import BaguaBucket, BucketOp
from bagua.torch_api.communication import ReduceOp
from bagua.torch_api.compression import (
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
from bagua.torch_api.process_group import BaguaCommunicator, BaguaProcessGroup

__all__ = [
    "SEGMENT",
    "ByteGradAlgorithm",
    "ByteGradAlgorithmImpl",
    "Workspace",
    "low_precision_allreduce_inplace",
    "centralized_low_precision_op",
    "all_finite",
    "FiniteVerdicts",
]

#: Elements of a chunk sent per collective; larger chunks are sent in several pipelined segments.
SEGMENT = 1 << 18

# torch >= 2.7 names it all_gather_single and deprecates all_gather_into_tensor (a FutureWarning per call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Workspace:
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
        "server_residual",
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


def bucket_tag(bucket: BaguaBucket) -> int:
    """A point-to-point tag of the bucket, the same on every rank (buckets are named alike everywhere)."""
    return zlib.crc32(bucket.name.encode()) & 0x7FFFFFFF


def centralized_low_precision_op(
    group: BaguaProcessGroup,
    hierarchical: bool = False,
    average: bool = True,
    error_feedback: bool = False,
    on_finite: Optional[Callable[[str, bool], None]] = None,
) -> BucketOp:
    """Return the bucket operation ``op(bucket, flat)`` of ByteGrad (and of QAdam's compressed stage).

    Flat: :func:`low_precision_allreduce_inplace` over the group. Hierarchical (when the group spans several
    nodes of several ranks): float32 reduce to each node's leader, the compressed allreduce among the leaders,
    broadcast inside each node. The buffers (and error-feedback residuals) of each bucket live in this op and
    are reused every step.

    Args:
        group: the process group.
        hierarchical: communicate hierarchically when the group's layout allows it.
        average: average (True) or sum (False).
        error_feedback: carry each rank's quantization error to the next step (see the module docstring).
        on_finite: called as ``on_finite(bucket.name, finite)`` after each run, ``finite`` telling whether the
            bucket's result holds only finite values (read from the 8-bit headers where possible, see
            :meth:`~bagua.torch_api.compression.ChunkParams.decodes_finite`).

    Example:
        >>> bucket.append_op(centralized_low_precision_op(group, hierarchical=False))  # doctest: +SKIP
    """
    workspaces: dict[tuple, Workspace] = {}

    def workspace_for(bucket: BaguaBucket, flat: torch.Tensor, c: BaguaCommunicator) -> Workspace:
        key = (bucket.name, flat.numel(), flat.dtype, flat.device, tuple(c.ranks))
        ws = workspaces.get(key)
        if ws is None:
            # a bucket rebuilt with another size: its old buffers (and residuals) cannot be reused
            for stale in [k for k in workspaces if k[0] == bucket.name]:
                del workspaces[stale]
            ws = workspaces[key] = Workspace(flat.numel(), c.nranks(), flat.device, error_feedback=error_feedback)
        return ws

    def low_precision_op(bucket: BaguaBucket, flat: torch.Tensor) -> None:
        finite: Optional[bool] = None
        if hierarchical and group.is_hierarchical_possible():
            bucket.materialize_pending()
            intra = group.get_intra_node_communicator()
            inter = group.get_inter_node_communicator()
            comm.reduce_inplace(flat, 0, ReduceOp.AVG if average else ReduceOp.SUM, intra)
            if inter.is_member() and inter.nranks() > 1:
                low_precision_allreduce_inplace(
                    flat, inter, average, workspace_for(bucket, flat, inter), tag=bucket_tag(bucket)
                )
            comm.broadcast(flat, 0, intra)
        else:
            c = group.get_global_communicator()
            if c.is_member() and c.nranks() > 1:
                ws = workspace_for(bucket, flat, c)
                # gradients not yet copied into the bucket are read where they are (no copy of the bucket)
                direct = bucket.has_pending() and ws.staging is None and ws.residual is None
                if not direct:
                    bucket.materialize_pending()
                finite = low_precision_allreduce_inplace(
                    flat, c, average, ws, source=bucket.pieces if direct else None, tag=bucket_tag(bucket)
                )
            else:
                bucket.materialize_pending()
        if bucket.padding:
            flat[bucket.numel :].zero_()  # the padding takes part in min/max: keep it zero, as in the maths
        if on_finite is not None:
            on_finite(bucket.name, all_finite(flat) if finite is None else finite)

    low_precision_op.reset = workspaces.clear  # type: ignore[attr-defined]  (drops buffers and residuals)
    low_precision_op.accepts_pending = True  # type: ignore[attr-defined]  (see BaguaBucket.defer_restore)
    return low_precision_op


NONFINITE_POLICIES = ("raise", "skip", "ignore")


class FiniteVerdicts:
    """The NaN/Inf verdicts of one step's buckets: recorded on the communication thread as each bucket finishes
    (``on_finite`` of :func:`centralized_low_precision_op`), taken by the post-backward hook for
    :func:`check_finite_after_communication`.

    Example:
        >>> verdicts = FiniteVerdicts(); verdicts.record("0", True)
        >>> verdicts.take(), verdicts.take()
        ({'0': True}, {})
    """

    def __init__(self) -> None:
        self._by_bucket: dict[str, bool] = {}

    def record(self, name: str, finite: bool) -> None:
        """Note bucket ``name``'s verdict."""
        self._by_bucket[name] = finite

    def take(self) -> dict[str, bool]:
        """The verdicts recorded since the last call (bucket name -> finite), forgetting them."""
        taken, self._by_bucket = self._by_bucket, {}
        return taken


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


def check_finite_after_communication(
    bagua_ddp, policy: str, algorithm: str, known: Optional[dict[str, bool]] = None
) -> bool:
    """Apply ``policy`` when a bucket holds NaN or Inf after an 8-bit allreduce; return whether all was finite.

    A NaN or Inf in any rank's tensor makes the min/max of its 8-bit chunk non-finite, which poisons the whole
    chunk on *every* rank. All ranks hold the same result after the allgather, so they all see the same answer
    here and act alike (no rank is left waiting): ``"raise"`` raises ``FloatingPointError``, ``"skip"`` drops
    every gradient of the step (the optimizer then skips every parameter), ``"ignore"`` does nothing.
    ``known`` maps bucket names to a verdict already reached (on the communication thread, see
    :class:`FiniteVerdicts`); the other buckets are checked here.
    """
    if policy == "ignore":
        return True
    bad = []
    for bucket in bagua_ddp.bagua_buckets:
        if known is not None and bucket.name in known:
            finite = known[bucket.name]
        else:
            tensors = [bucket.flat] if bucket.flat is not None else [t.effective() for t in bucket.tensors]
            finite = all(all_finite(t) for t in tensors)
        if not finite:
            bad.append(bucket.name)
    if not bad:
        return True
    if policy == "raise":
        raise FloatingPointError(
            f"rank {dist.get_rank()}: {algorithm} produced NaN/Inf in bucket(s) {bad}: some rank's gradient was not "
            "finite, and 8-bit compression spreads that to its whole chunk on every rank. Lower the learning rate, "
            "clip gradients, or use torch.amp.GradScaler"
            + (", or pass nonfinite='skip' to skip such steps." if algorithm == "ByteGrad" else
               " (for QAdam: a longer warmup_steps gives a better-estimated frozen variance).")
        )
    for t in bagua_ddp._bagua_tensors:  # "skip": the optimizer skips parameters whose gradient is None
        t.param.grad = None
    for bucket in bagua_ddp.bagua_buckets:
        for op in bucket._ops:
            getattr(op, "reset", lambda: None)()  # residuals of error feedback may hold NaN: start afresh
    return False


class ByteGradAlgorithmImpl(AlgorithmImpl):
    """ByteGrad bound to a group; see :class:`ByteGradAlgorithm`."""

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        hierarchical: bool = True,
        average: bool = True,
        error_feedback: bool = False,
        nonfinite: str = "raise",
    ) -> None:
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.average = average
        self.error_feedback = error_feedback
        self.nonfinite = nonfinite
        self._verdicts = FiniteVerdicts()

    def init_post_backward_hook(self, bagua_ddp):
        def hook() -> None:
            bagua_ddp.launch_remaining_buckets()
            bagua_ddp.wait_pending_comm_ops()
            check_finite_after_communication(bagua_ddp, self.nonfinite, "ByteGrad", self._verdicts.take())

        return hook

    def tensors_to_buckets(self, tensors, do_flatten: bool) -> list[BaguaBucket]:
        # padded to the group size so that every bucket splits into one equal chunk per rank
        alignment = self.process_group.get_global_communicator().nranks()
        return [
            BaguaBucket(group, name=str(i), flatten=do_flatten, alignment=alignment) for i, group in enumerate(tensors)
        ]

    def init_operations(self, bagua_ddp, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        bucket.append_op(
            centralized_low_precision_op(
                self.process_group,
                self.hierarchical,
                self.average,
                error_feedback=self.error_feedback,
                on_finite=None if self.nonfinite == "ignore" else self._verdicts.record,
            )
        )


@GlobalAlgorithmRegistry.register("bytegrad", description="gradients averaged in 8 bits (MinMaxUInt8 scatter-gather)")
@dataclass
class ByteGradAlgorithm(Algorithm):
    """Average gradients after every backward, sending them in 8 bits (about 4x less than float32).

    Args:
        hierarchical: reduce inside each node in float32 and compress only among node leaders; this sends less
            over the slow inter-node network when there are several ranks per node.
        average: average the gradients (True) or sum them (False).
        error_feedback: add each rank's quantization error of the previous steps to its gradient before
            compressing (and the chunk owners' error of the second quantization likewise), so that
            quantization errors do not accumulate; costs one float32 copy of the gradients in memory.
        nonfinite: what to do when a gradient holds NaN/Inf (which 8-bit compression would spread over its
            whole chunk on every rank): ``"raise"`` (``FloatingPointError`` on every rank), ``"skip"`` (drop the
            step's gradients on every rank, so the optimizer skips the step) or ``"ignore"``.

    Example:
        >>> from bagua.torch_api.algorithms import bytegrad
        >>> model = model.with_bagua([optimizer], bytegrad.ByteGradAlgorithm())  # doctest: +SKIP
    """

    hierarchical: bool = True
    average: bool = True
    error_feedback: bool = False
    nonfinite: str = "raise"

    def __post_init__(self) -> None:
        for name in ("hierarchical", "average", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ByteGradAlgorithm({name}=...) must be True or False, got {getattr(self, name)!r}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"ByteGradAlgorithm(nonfinite={self.nonfinite!r}): choose one of {NONFINITE_POLICIES}")

    def reify(self, process_group: BaguaProcessGroup) -> ByteGradAlgorithmImpl:
        return ByteGradAlgorithmImpl(
            process_group,
            hierarchical=self.hierarchical,
            average=self.average,
            error_feedback=self.error_feedback,
            nonfinite=self.nonfinite,
        )
