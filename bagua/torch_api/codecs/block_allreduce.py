"""The block-wise compressed allreduce: a :mod:`~bagua.torch_api.codecs.block` codec around a scatter-reduce-gather.

With ``Q``/``D`` the codec's encode/decode (chunk by chunk), ``n`` ranks and rank ``i``'s input ``x_i``, every rank
ends with the same ::

    y = D(Q( (D(Q(x_0)) + D(Q(x_1)) + ... + D(Q(x_{n-1}))) / n ))       (sum in rank order, float32)

(without the ``/ n`` when ``average=False``). The flat tensor of ``N`` elements splits into ``n`` chunks of ``C``
elements, ``C = ceil(ceil(N / block_size) / n) * block_size``, so that blocks never straddle chunks (the last
chunks are shorter, possibly empty); a tensor of fewer blocks than ranks splits into chunks of ``ceil(N / n)``,
one short block each. The steps, for rank ``r``:

1. with error feedback, ``x = flat + e`` and the rank's residual becomes ``e = x - D(Q(x))``;
2. encode every chunk; send chunk ``j`` to rank ``j`` point to point (its own never travels);
3. decode the ``n`` copies of chunk ``r`` and add them in rank order in float32, divide by ``n`` (a true
   division) when averaging, and add the server residual ``s`` with error feedback;
4. encode the reduced chunk ``y_r`` (``s = y_r - D(Q(y_r))``) and all-gather the encoded chunks;
5. decode every chunk into ``flat``.

Every element is quantized twice and every rank decodes the same bytes, so every rank ends with bit-identical
``flat``. Error feedback carries each quantization error to the next call (1-bit SGD/EF-SGD style; Karimireddy et
al. 2019, https://arxiv.org/abs/1901.09847); the residuals live in the :class:`BlockWorkspace`.

Messages are one per chunk: splitting them into pipelined segments (as ByteGrad does) is left out until a
measurement shows it pays here. The schedule is
:func:`~bagua.torch_api.codecs.scatter_reduce_gather.scatter_reduce_gather`'s, shared with ByteGrad's per-chunk
code; this module gives it the codec (:class:`_BlockCodec`).

Example:
    >>> c = bagua.communication._get_default_group().get_global_communicator()  # doctest: +SKIP
    >>> ws = block_allreduce_inplace(pseudo_grad, c, "uint4")  # doctest: +SKIP
    >>> ws = block_allreduce_inplace(pseudo_grad, c, "uint4", workspace=ws)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from bagua.torch_api.codecs.block import DEFAULT_BLOCK, SPARSE, decode, encode, wire_numel
from bagua.torch_api.comm.collectives import allgather
from bagua.torch_api.comm.process_group import BaguaCommunicator
from bagua.torch_api.codecs.residuals import ErrorFeedbackResiduals
from bagua.torch_api.codecs.scatter_reduce_gather import SegmentCodec, Wait, scatter_reduce_gather
from bagua.torch_api.codecs.scatter_reduce_gather import post_receives_first as _post_receives_first

__all__ = ["BlockWorkspace", "block_allreduce_inplace", "chunk_length", "allgather_decode"]


def chunk_length(numel: int, nranks: int, block_size: int = DEFAULT_BLOCK) -> int:
    """Return ``C``, the elements of each rank's chunk (see the module docstring).

    Example:
        >>> chunk_length(10_000, 2, 4096), chunk_length(5, 2, 4096)
        (8192, 3)
    """
    blocks = -(-numel // block_size)
    if blocks >= nranks:
        return -(-blocks // nranks) * block_size
    return -(-numel // nranks)


class BlockWorkspace(ErrorFeedbackResiduals):
    """The buffers of one tensor's block-wise compressed allreduce, reused every call, and its residuals.

    Args:
        numel: elements of the flat tensor.
        nranks: ranks of the communicator.
        codec: one of :data:`~bagua.torch_api.codecs.block.CODECS`.
        block_size: the codec's block size.
        keep_previous: with error feedback, keep a copy of the residuals from before each call, so that
            :meth:`rollback` can undo a call whose result was not finite (one more float32 copy of the tensor and
            of the chunk; ByteGrad's gradients need it, DiLoCo's outer gradients do not).

    The wire buffers are allocated at the first call that communicates, on its tensor's device; the residuals at
    the first call with ``error_feedback=True`` (zeros) or by :meth:`load_state_dict`.

    Example:
        >>> ws = BlockWorkspace(10_000, 2, "uint4")
        >>> ws.chunk, ws.bounds(1)
        (8192, (8192, 10000))
    """

    __slots__ = (
        # what it serves
        "numel", "nranks", "codec", "block_size", "chunk", "slot",
        # wire buffers: n slots of `slot` bytes each (recv is reused as the all-gather output)
        "send", "recv", "mine",
        # error feedback: this rank's residual (numel) and, as the owner of its chunk, the server residual (chunk);
        # with keep_previous, both as they were before the last call
        "residual", "server_residual", "keep_previous", "previous",
    )

    def __init__(self, numel: int, nranks: int, codec: str, block_size: int = DEFAULT_BLOCK,
                 keep_previous: bool = False) -> None:
        if numel < 0 or nranks < 1:
            raise ValueError(f"BlockWorkspace needs numel >= 0 and nranks >= 1, got {numel} and {nranks}")
        self.numel, self.nranks, self.codec, self.block_size = numel, nranks, codec, block_size
        self.chunk = chunk_length(numel, nranks, block_size)
        # slots start on 8-byte boundaries, so that every chunk's float32 headers can be viewed in place
        self.slot = -(-wire_numel(self.chunk, codec, block_size) // 8) * 8
        self.send = self.recv = self.mine = None
        self.residual = self.server_residual = None
        self.keep_previous, self.previous = keep_previous, None

    def bounds(self, j: int) -> tuple[int, int]:
        """The element range ``[a, b)`` of chunk ``j``."""
        a = min(j * self.chunk, self.numel)
        return a, min(a + self.chunk, self.numel)

    def check(self, numel: int, nranks: int, codec: str, block_size: int) -> None:
        """Raise ``ValueError`` unless the workspace serves this tensor size, rank count, codec and block size."""
        mine = (self.numel, self.nranks, self.codec, self.block_size)
        if mine != (numel, nranks, codec, block_size):
            raise ValueError(
                f"this BlockWorkspace serves {self.numel} elements on {self.nranks} ranks ({self.codec}, block "
                f"{self.block_size}), not {numel} on {nranks} ({codec}, block {block_size}): keep one workspace per "
                "tensor and communicator, or pass workspace=None for a new one (its residuals start at zero)"
            )

    @property
    def device(self) -> Optional[torch.device]:
        """The device of the buffers; ``None`` before the first call that communicates."""
        return None if self.send is None else self.send.device

    def bytes_sent(self) -> int:
        """Return the bytes a rank sends in one call: its n-1 peers' encoded chunks, then its own chunk to each of
        them (counted as full chunks: the last chunks may be shorter).

        Example:
            >>> BlockWorkspace(10_000, 2, "uint8").bytes_sent()  # 2 * (8192 + 2 * 8)
            16416
        """
        if self.codec in SPARSE:  # its whole wire to each peer (the all-gather)
            return (self.nranks - 1) * wire_numel(self.numel, self.codec, self.block_size)
        return 2 * (self.nranks - 1) * wire_numel(self.chunk, self.codec, self.block_size)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the residuals of :meth:`state_dict` (an empty dict clears them).

        Example:
            >>> BlockWorkspace(10, 2, "uint8").state_dict()
            {}
        """
        self.previous = None
        if not state:
            self.residual = self.server_residual = None
            return
        shapes = {"residual": (self.numel,), "server_residual": (self.chunk,)}
        for key, shape in shapes.items():
            if key not in state or tuple(state[key].shape) != shape:
                got = tuple(state[key].shape) if key in state else "missing"
                raise ValueError(f"{key}: expected shape {shape} for {self.numel} elements on {self.nranks} ranks, "
                                 f"got {got}; the checkpoint was saved for another tensor or rank count")
        device = self.send.device if self.send is not None else state["residual"].device
        self.residual = state["residual"].detach().to(device, torch.float32, copy=True)
        self.server_residual = state["server_residual"].detach().to(device, torch.float32, copy=True)

    def allreduce_inplace(self, flat: torch.Tensor, c: BaguaCommunicator, *, average: bool = True,
                          error_feedback: bool = False, tag: int = 0, source: Optional[object] = None) -> None:
        """Run :func:`block_allreduce_inplace` on ``flat`` (any float dtype: computed on a float32 copy of another
        and copied back) with this workspace. Returns ``None``: read the result for a finite verdict (a block
        holding a NaN or an Inf decodes to NaN on every rank)."""
        if source is not None:
            raise ValueError("source= reads the input in pieces for the 'chunk' codec only")
        x = flat if flat.dtype == torch.float32 else flat.float()
        block_allreduce_inplace(x, c, self.codec, self.block_size, average, self, error_feedback, tag)
        if x is not flat:
            flat.copy_(x)
        return None

    def _prepare(self, device: torch.device, error_feedback: bool) -> None:
        if self.send is None or self.send.device != device:
            self.send = torch.zeros(self.nranks * self.slot, dtype=torch.uint8, device=device)
            self.recv = torch.zeros_like(self.send)
            self.mine = torch.zeros(self.slot, dtype=torch.uint8, device=device)
        if error_feedback and self.residual is None:
            self.residual = torch.zeros(self.numel, dtype=torch.float32, device=device)
            self.server_residual = torch.zeros(self.chunk, dtype=torch.float32, device=device)
        elif self.residual is not None and self.residual.device != device:
            self.residual, self.server_residual = self.residual.to(device), self.server_residual.to(device)
        if error_feedback and self.keep_previous:
            if self.previous is None or self.previous[0].device != device:
                self.previous = (torch.empty_like(self.residual), torch.empty_like(self.server_residual))
            self.previous[0].copy_(self.residual)
            self.previous[1].copy_(self.server_residual)


class _BlockCodec(SegmentCodec):
    """A :mod:`~bagua.torch_api.codecs.block` codec for :func:`scatter_reduce_gather`: one segment per chunk, the
    chunks the workspace's ranges of ``flat`` (each in its own wire slot; an empty chunk does not travel)."""

    def __init__(self, ws: BlockWorkspace, flat: torch.Tensor, rank: int, average: bool,
                 error_feedback: bool) -> None:
        self.ws, self.rank, self.average, self.error_feedback = ws, rank, average, error_feedback
        n, W = ws.nranks, ws.slot
        self.ranges = [ws.bounds(j) for j in range(n)]
        self.lengths = [b - a for a, b in self.ranges]
        self.sizes = [wire_numel(m, ws.codec, ws.block_size) for m in self.lengths]
        self.send = [ws.send[j * W : j * W + self.sizes[j]] for j in range(n)]
        self.recv = [ws.recv[i * W : i * W + self.sizes[rank]] for i in range(n)]  # rank i's copy of chunk r
        self.chunks = [flat[a:b] for a, b in self.ranges]

    def sends_to(self, j: int) -> bool:
        return self.lengths[j] > 0

    def receives(self) -> bool:
        return self.lengths[self.rank] > 0

    def send_buffer(self, k: int, j: int) -> torch.Tensor:
        return self.send[j]

    def recv_buffer(self, k: int, i: int) -> torch.Tensor:
        return self.recv[i]

    def _encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        encode(x, self.ws.codec, self.ws.block_size, out=out)

    def _decode(self, wire: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
        decode(wire, out.numel(), self.ws.codec, self.ws.block_size, out=out, accumulate=accumulate)

    def encode_peer(self, k: int, j: int) -> None:
        self._encode(self.chunks[j], self.send[j])

    def encode_own(self, k: int) -> None:
        self._encode(self.chunks[self.rank], self.recv[self.rank])

    def keep_residuals(self) -> None:
        if self.error_feedback:  # e = x - D(Q(x)), while the chunks travel
            for j, (a, b) in enumerate(self.ranges):
                e = self.ws.residual[a:b]
                self._decode(self.recv[self.rank] if j == self.rank else self.send[j], e)
                torch.sub(self.chunks[j], e, out=e)

    def reduce(self, k: int, wait: Wait) -> None:
        y = self.chunks[self.rank]  # the sum of the n decoded copies of chunk r, in rank order
        for i in range(self.ws.nranks):
            wait(i)
            self._decode(self.recv[i], y, accumulate=i > 0)
        if self.average:
            y.div_(torch.full((1,), self.ws.nranks, dtype=torch.float32, device=y.device))  # not * (1/n): true
        if self.error_feedback:
            y.add_(self.ws.server_residual[: y.numel()])

    def encode_reduced(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._encode(self.chunks[self.rank], self.ws.mine[: self.sizes[self.rank]])
        return self.ws.recv, self.ws.mine

    def keep_server_residual(self, k: int) -> None:
        if self.error_feedback:  # s = y - D(Q(y))
            y = self.chunks[self.rank]
            s = self.ws.server_residual[: y.numel()]
            self._decode(self.ws.mine[: self.sizes[self.rank]], s)
            torch.sub(y, s, out=s)

    def decode_gathered(self, k: int) -> None:
        W = self.ws.slot
        for j, chunk in enumerate(self.chunks):
            self._decode(self.ws.recv[j * W : j * W + self.sizes[j]], chunk)


def block_allreduce_inplace(
    flat: torch.Tensor,
    c: BaguaCommunicator,
    codec: str,
    block_size: int = DEFAULT_BLOCK,
    average: bool = True,
    workspace: Optional[BlockWorkspace] = None,
    error_feedback: bool = False,
    tag: int = 0,
) -> BlockWorkspace:
    """Average (or sum) ``flat`` over the communicator ``c`` through the codec: steps 1-5 of the module docstring.

    The schedule is :func:`~bagua.torch_api.codecs.scatter_reduce_gather.scatter_reduce_gather`'s.

    Args:
        flat: a contiguous 1-D float32 tensor, the same size on every rank; overwritten with the result.
        c: the communicator; a non-member or a one-rank communicator (or an empty ``flat``) leaves ``flat``
            unchanged.
        codec: ``"bf16"``, ``"uint8"`` or ``"uint4"``.
        block_size: the codec's block size.
        average: divide the sum by the number of ranks.
        workspace: the workspace of an earlier call on this tensor (buffers and residuals); a new one otherwise.
        error_feedback: add the residuals of the previous calls before quantizing, and keep the new ones (and,
            with the workspace's ``keep_previous``, the old ones for :meth:`BlockWorkspace.rollback`).
        tag: the point-to-point tag of step 2 (calls in flight at the same time on one group need different tags).

    Returns:
        The workspace, to pass to the next call.

    Example:
        >>> ws = None  # doctest: +SKIP
        >>> for step in range(steps):  # doctest: +SKIP
        ...     ws = block_allreduce_inplace(delta, c, "uint4", workspace=ws, error_feedback=True)
    """
    if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat must be a contiguous 1-D float32 tensor, got {flat.dtype} {tuple(flat.shape)}")
    n = c.nranks()
    ws = workspace if workspace is not None else BlockWorkspace(flat.numel(), n, codec, block_size)
    ws.check(flat.numel(), n, codec, block_size)
    if c.group is None or n == 1 or flat.numel() == 0:
        return ws
    if codec in SPARSE:
        _allgather_inplace(flat, c, ws, average, error_feedback)
        return ws
    c.check_point_to_point(flat, f"the block-wise {codec} scatter-reduce (ByteGrad, QAdam, DiLoCo)")
    ws._prepare(flat.device, error_feedback)
    if error_feedback:
        flat.add_(ws.residual)  # 1: x = flat + e
    # this module's _post_receives_first, looked up now: the tests swap it for the NCCL order
    scatter_reduce_gather(_BlockCodec(ws, flat, c.rank(), average, error_feedback), c, tag,
                          _post_receives_first(c.group))
    return ws


@torch.no_grad()
def _allgather_inplace(flat: torch.Tensor, c: BaguaCommunicator, ws: BlockWorkspace, average: bool,
                       error_feedback: bool) -> None:
    """A sparse codec's exchange: encode ``flat`` (plus the residual) once, all-gather the wires, and decode-sum
    them in rank order into ``flat`` (:func:`allgather_decode`: a sparse sum cannot be re-sparsified without loss).
    The residual becomes ``x - D(Q(x))``."""
    n = c.nranks()
    if error_feedback:
        if ws.residual is None or ws.residual.device != flat.device:
            ws.residual = torch.zeros(ws.numel, dtype=torch.float32, device=flat.device) if ws.residual is None \
                else ws.residual.to(flat.device)
            ws.server_residual = torch.zeros(ws.chunk, dtype=torch.float32, device=flat.device)
        if ws.keep_previous:
            ws.previous = (ws.residual.clone(), ws.server_residual.clone())
        flat.add_(ws.residual)

    def gather(wire: torch.Tensor) -> list[torch.Tensor]:
        wires = torch.empty(n * wire.numel(), dtype=torch.uint8, device=flat.device)
        allgather(wire, wires, c)
        return list(wires.view(n, -1))

    total, wire = allgather_decode(flat, ws.codec, gather, ws.block_size, average=average)
    if error_feedback:
        ws.residual.copy_(flat).sub_(decode(wire, flat.numel(), ws.codec, ws.block_size))
    flat.copy_(total)


@torch.no_grad()
def allgather_decode(x: torch.Tensor, codec: str, all_gather: Callable[[torch.Tensor], Optional[list[torch.Tensor]]],
                     block_size: int = DEFAULT_BLOCK, weights: Optional[Sequence[float]] = None, average: bool = True,
                     ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Encode ``x`` once with the block ``codec``, all-gather the wires, and decode-sum them in member order.

    Every member decodes the same wires in the same order, so every member ends with the same result, bit for bit.
    ``weights`` (one per member, e.g. the samples behind it; 0 adds nothing) give the weighted average; without
    them the sum, divided by the number of wires when ``average``. Returns ``(result, wire)`` (this member's own
    wire, for its residual ``x - decode(wire)``), or ``None`` when ``all_gather`` returned ``None`` (a failed
    fault-tolerant round).

    Example:
        >>> allgather_decode(torch.tensor([1.0, 3.0]), "bf16", lambda wire: [wire, wire])[0]
        tensor([1., 3.])
    """
    n = x.numel()
    wire = encode(x, codec, block_size)
    wires = all_gather(wire)
    if wires is None:
        return None
    out = torch.zeros(n, dtype=torch.float32, device=x.device)
    if weights is None:
        for w in wires:
            decode(w, n, codec, block_size, out=out, accumulate=True)
        if average:
            out.div_(len(wires))
    else:
        total = max(1, sum(weights))
        for w, weight in zip(wires, weights):
            if weight:
                out.add_(decode(w, n, codec, block_size), alpha=weight / total)
    return out, wire
