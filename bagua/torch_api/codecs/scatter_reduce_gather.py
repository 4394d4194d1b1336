"""The scatter-reduce-gather of the compressed allreduces, written once: the codec is passed in as a small object.

Both 8-bit collectives (:func:`~bagua.torch_api.codecs.compressed_allreduce.low_precision_allreduce_inplace`,
MinMaxUInt8 with one header per rank chunk, and
:func:`~bagua.torch_api.codecs.block_allreduce.block_allreduce_inplace`, the block-wise codes) run the same
schedule; only what they encode, decode and keep differs. With ``n`` ranks in the communicator, for rank ``r``,
each chunk possibly sent in several segments (``codec.segments``):

1. post every receive first (gloo; see :func:`post_receives_first`);
2. encode every peer's chunk, segment by segment, and send each one as soon as it is encoded (NCCL: each
   segment's sends and receives go together in one ``batch_isend_irecv`` once its peers are encoded); then encode
   the rank's own chunk (it never travels) and keep the error-feedback residuals while the peers' are on the wire;
3. reduce each segment of chunk ``r`` (the codec waits for each source's copy before using it);
4. encode each reduced segment and all-gather it, asynchronously; keep the server residual meanwhile;
5. decode each gathered segment as it arrives.

The codec (:class:`SegmentCodec`) holds the buffers and the numerics, and the callers' module seams
(``dist``, ``_all_gather_single``, ``_post_receives_first``) are passed in, so that tests and
``benchmarks/bytegrad_timeline.py`` can still wrap them where they live.

Example:
    >>> c = bagua.communication._get_default_group().get_global_communicator()  # doctest: +SKIP
    >>> scatter_reduce_gather(codec, c, tag=3)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.comm.collectives import all_gather_tensor
from bagua.torch_api.comm.process_group import BaguaCommunicator

__all__ = ["SegmentCodec", "Wait", "post_receives_first", "scatter_reduce_gather"]

#: ``wait(i)``: block until rank ``i``'s copy of the current segment of the rank's chunk has arrived (a no-op for
#: the rank itself, and for a rank that sends nothing).
Wait = Callable[[int], None]


class SegmentCodec:
    """What :func:`scatter_reduce_gather` asks of a codec: its buffers and its steps, segment ``k`` by segment.

    Subclasses fill in every method; ``segments`` is the number of segments per chunk.
    """

    segments: int = 1

    def sends_to(self, j: int) -> bool:
        """Whether chunk ``j`` travels to rank ``j`` (an empty chunk does not)."""
        return True

    def receives(self) -> bool:
        """Whether the peers' copies of the rank's own chunk travel (an empty chunk does not)."""
        return True

    def send_buffer(self, k: int, j: int) -> torch.Tensor:
        """The encoded segment ``k`` of chunk ``j``, as sent to rank ``j``."""
        raise NotImplementedError

    def recv_buffer(self, k: int, i: int) -> torch.Tensor:
        """Where rank ``i``'s encoded segment ``k`` of the rank's own chunk arrives."""
        raise NotImplementedError

    def encode_peer(self, k: int, j: int) -> None:
        """Encode segment ``k`` of peer ``j``'s chunk into ``send_buffer(k, j)``."""
        raise NotImplementedError

    def encode_own(self, k: int) -> None:
        """Encode segment ``k`` of the rank's own chunk into ``recv_buffer(k, rank)``."""
        raise NotImplementedError

    def keep_residuals(self) -> None:
        """With error feedback, keep this rank's quantization error (every chunk is encoded by now)."""

    def reduce(self, k: int, wait: Wait) -> None:
        """Reduce segment ``k`` of the rank's chunk from the ``n`` copies (call ``wait(i)`` before reading copy
        ``i``)."""
        raise NotImplementedError

    def encode_reduced(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode reduced segment ``k``; return the all-gather's ``(output, input)`` for it."""
        raise NotImplementedError

    def keep_server_residual(self, k: int) -> None:
        """With error feedback, keep the quantization error of reduced segment ``k`` (while it travels)."""

    def decode_gathered(self, k: int) -> None:
        """Decode every chunk's gathered segment ``k`` into the result."""
        raise NotImplementedError


def post_receives_first(group: Any) -> bool:
    """Whether step 2 posts every receive before its first send (gloo), or sends and receives each segment as one
    group (NCCL and others).

    A gloo send waits for the receiver's "ready" message; posted late, that message queues behind the receiver's
    own outgoing data and the exchange runs at half the link's rate. NCCL runs a pair's operations in order on
    one stream, so a receive posted ahead of the matching send would block it: there each segment's sends and
    receives go together through ``batch_isend_irecv``.
    """
    return dist.get_backend(group) == "gloo"


def scatter_reduce_gather(
    codec: SegmentCodec,
    c: BaguaCommunicator,
    tag: int = 0,
    receives_first: Optional[bool] = None,
    p2p: Any = dist,
    all_gather: Callable[..., Any] = all_gather_tensor,
) -> None:
    """Run steps 1-5 of the module docstring over the communicator ``c`` (a member, of two ranks or more).

    Args:
        codec: the codec with its buffers (:class:`SegmentCodec`).
        c: the communicator.
        tag: the point-to-point tag (calls in flight at the same time on one group need different tags).
        receives_first: the gloo order; ``None``: :func:`post_receives_first` of the group.
        p2p: ``torch.distributed`` or a stand-in with ``isend``, ``irecv``, ``P2POp`` and ``batch_isend_irecv``.
        all_gather: ``all_gather_single(output, input, group=, async_op=)``.

    Example:
        >>> scatter_reduce_gather(codec, c, tag=3)  # doctest: +SKIP
    """
    if receives_first is None:
        receives_first = post_receives_first(c.group)
    pending, sends = _scatter(codec, c, tag, receives_first, p2p)

    # 3: reduce each segment as its copies arrive
    for k in range(codec.segments):
        codec.reduce(k, lambda i, inbox=pending[k]: _wait(inbox, i))

    # 4: encode and all-gather each reduced segment
    gathers = []
    for k in range(codec.segments):
        output, mine = codec.encode_reduced(k)
        if k == 0:  # the send buffers are free again before the gather's traffic starts
            for inbox in pending:
                for i in list(inbox):
                    _wait(inbox, i)
            for work in sends:
                work.wait()
        gathers.append(all_gather(output.view(-1), mine.view(-1), group=c.group, async_op=True))
        codec.keep_server_residual(k)

    # 5: decode each gathered segment as it arrives
    for k, work in enumerate(gathers):
        work.wait()
        codec.decode_gathered(k)


def _wait(inbox: dict[int, list], i: int) -> None:
    """Wait for the works of source ``i`` in ``inbox``, once: they are emptied (shared by a batch's sources)."""
    works = inbox.pop(i, [])
    for work in works:
        work.wait()
    works.clear()


def _scatter(codec: SegmentCodec, c: BaguaCommunicator, tag: int, receives_first: bool,
             p2p: Any) -> tuple[list[dict[int, list]], list]:
    """Steps 1-2: post the receives (gloo), encode and send the peers' chunks, encode the own one; return the
    receives by segment and source, and the sends."""
    n, r = c.nranks(), c.rank()
    peers = [(r + d) % n for d in range(1, n)]
    sources = peers if codec.receives() else []
    pending: list[dict[int, list]] = [{} for _ in range(codec.segments)]
    sends: list = []
    if receives_first:
        for k in range(codec.segments):
            pending[k] = {i: [p2p.irecv(codec.recv_buffer(k, i), c.global_rank(i), group=c.group, tag=tag)]
                          for i in sources}
    for k in range(codec.segments):
        for j in peers:
            codec.encode_peer(k, j)
            if receives_first and codec.sends_to(j):
                sends.append(p2p.isend(codec.send_buffer(k, j), c.global_rank(j), group=c.group, tag=tag))
        if not receives_first:  # each segment's sends and receives in one group, in the same order on every rank
            ops = [p2p.P2POp(p2p.isend, codec.send_buffer(k, j), c.global_rank(j), c.group, tag)
                   for j in peers if codec.sends_to(j)]
            ops += [p2p.P2POp(p2p.irecv, codec.recv_buffer(k, i), c.global_rank(i), c.group, tag) for i in sources]
            batch = p2p.batch_isend_irecv(ops) if ops else []
            # one list for every source: the first wait waits the whole batch (NCCL may return a single work for
            # it) and empties it, as a gloo work must not be waited twice (its second wait waits for more data)
            pending[k] = {i: batch for i in sources}
            if not sources:
                sends += batch
    for k in range(codec.segments):
        codec.encode_own(k)
    codec.keep_residuals()
    return pending, sends
