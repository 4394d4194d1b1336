"""Where a DiLoCo fragment's pseudo-gradient is averaged: over the ranks of a communicator, or over the members of a
fault-tolerant round. One interface, so a fragment has one exchange path and one place for its residuals.

:meth:`~bagua.torch_api.ops.diloco.Fragment.exchange` calls ``over.average(delta)`` (float32) or
``over.compressed_average(fragment, codec, block_size, error_feedback)`` (a block codec: ``"bf16"``, ``"uint8"``,
``"uint4"``, ``"nf2"``), and keeps what it returns in ``fragment.workspace``, which its checkpoint saves:

- :class:`OverRanks`: every rank of a :class:`~bagua.torch_api.comm.process_group.BaguaCommunicator`; float32
  allreduce, or the block codec's scatter-reduce-gather
  (:func:`~bagua.torch_api.codecs.block_allreduce.block_allreduce_inplace`, its residuals in a
  :class:`~bagua.torch_api.codecs.block_allreduce.BlockWorkspace`);
- :class:`OverMembers`: the members of one round of :class:`~bagua.torch_api.fault.replica.FaultTolerance`,
  weighted by the samples each contributed (a healed member adds zeros). Compressed: each member's pseudo-gradient
  (plus its error-feedback residual) is encoded once and all-gathered, and every member decodes and sums the wires
  in member order: the same bytes in the same order, so every member ends with the same average, bit for bit. An
  all-gather rather than a scatter-reduce-gather: nothing is re-quantized, so a failed round leaves nothing
  half-reduced. The new residual waits in :class:`MemberResiduals` until the round's verdict is ``ok``
  (:meth:`MemberResiduals.commit`; a retried round starts again from the old one).

With ``rounds="time"`` or the link rule (:mod:`~bagua.torch_api.ops.diloco_pace`), each exchange is preceded by
a report: every rank's row of :data:`~bagua.torch_api.ops.diloco_pace.ROW` gathered into one small float64 table
(:meth:`OverRanks.report`: a one-hot SUM allreduce on the exchange's communicator; :meth:`OverMembers.report`: an
all-gather over the round's members), and over the ranks the pseudo-gradient is scaled by its tokens
(:func:`scale_by_tokens`) so that the plain average is the token-weighted one.

Example:
    >>> sent = fragment.exchange(OverRanks(c), "uint4", 4096, error_feedback=True)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from bagua.torch_api import communication as comm
from bagua.torch_api.codecs.block import SPARSE, decode, wire_numel
from bagua.torch_api.codecs.block_allreduce import block_allreduce_inplace
from bagua.torch_api.codecs.workspace import allgather_average
from bagua.torch_api.comm.cost import ring_allreduce_bytes
from bagua.torch_api.comm.process_group import BaguaCommunicator
from bagua.torch_api.communication import ReduceOp
from bagua.torch_api.fault.replica import FaultTolerance
from bagua.torch_api.fault.records import Round

__all__ = ["OverRanks", "OverMembers", "MemberResiduals", "float32_allreduce_bytes", "wire_bytes",
           "scale_by_tokens"]


def float32_allreduce_bytes(numel: int, members: int) -> int:
    """Bytes one rank sends in a float32 ring allreduce of ``numel`` values among ``members``."""
    return int(ring_allreduce_bytes(4 * numel, members))


def wire_bytes(numel: int, codec: str, block_size: int, members: int) -> int:
    """Bytes one member sends in a compressed all-gather: its wire to each of the other members."""
    return (members - 1) * wire_numel(numel, codec, block_size)


def scale_by_tokens(delta: torch.Tensor, tokens: list[float], me: int) -> None:
    """Scale this rank's (``me``) ``delta`` by ``w_me * N / W`` (``w``: the ranks' ``tokens``, ``N`` of them,
    ``W`` their sum), so that the plain mean over the ranks is the token-weighted mean; nothing when the tokens are
    equal (the mean is then exactly today's).

    Example:
        >>> d = torch.ones(2); scale_by_tokens(d, [3.0, 1.0], 0); d
        tensor([1.5000, 1.5000])
    """
    if all(w == tokens[0] for w in tokens) or sum(tokens) <= 0:
        return
    delta.mul_(tokens[me] * len(tokens) / sum(tokens))


class OverRanks:
    """Average over every rank of the communicator ``c`` (each calls it)."""

    def __init__(self, c: BaguaCommunicator) -> None:
        self.c = c

    def report(self, row: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Every rank's ``row`` in rank order (a one-hot SUM allreduce of float64 on ``device``, the
        communicator's), as a CPU table."""
        table = torch.zeros(self.c.nranks(), row.numel(), dtype=torch.float64, device=device)
        table[self.c.rank()] = row.to(device)
        if self.c.nranks() > 1:
            comm.allreduce_inplace(table, ReduceOp.SUM, self.c)
        return table.cpu()

    def average(self, delta: torch.Tensor) -> int:
        """Float32 allreduce of ``delta`` in place; return the bytes this rank sent."""
        comm.allreduce_inplace(delta, ReduceOp.AVG, self.c)
        return float32_allreduce_bytes(delta.numel(), self.c.nranks())

    def compressed_average(self, fragment: Any, codec: str, block_size: int, error_feedback: bool) -> int:
        """The block codec's scatter-reduce-gather of ``fragment.delta`` in place, its buffers and residuals in
        ``fragment.workspace``; return the bytes this rank sent."""
        n, r = self.c.nranks(), self.c.rank()
        ws = fragment.workspace = block_allreduce_inplace(fragment.delta, self.c, codec, block_size, average=True,
                                                          workspace=fragment.workspace,
                                                          error_feedback=error_feedback, tag=fragment.index)
        if codec in SPARSE:  # an all-gather: the whole wire to every peer
            return ws.bytes_sent()
        # this rank's encoded chunks to their owners, then its encoded share of the average to every peer
        return sum(wire_numel(ws.bounds(j)[1] - ws.bounds(j)[0], codec, block_size)
                   for j in range(n) if j != r) + (n - 1) * ws.slot


class MemberResiduals:
    """A fault-tolerant worker's error-feedback residual for one fragment (what its encoding lost), and the new one
    a round computed, kept only once the round's verdict is ``ok``."""

    def __init__(self) -> None:
        self.residual: Optional[torch.Tensor] = None
        self.candidate: Optional[torch.Tensor] = None

    def commit(self) -> None:
        """The round was ``ok``: its residual is this worker's now."""
        if self.candidate is not None:
            self.residual, self.candidate = self.candidate, None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"residual": ...}``, or empty before the first compressed round."""
        return {} if self.residual is None else {"residual": self.residual}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned (an empty dict clears it)."""
        self.residual = state["residual"].detach().clone() if "residual" in state else None
        self.candidate = None


class OverMembers:
    """Average over the members of the fault-tolerant round ``rnd`` of ``ft`` (weighted; a healed member adds
    zeros). Errors are recorded by ``ft`` (its verdict is then ``retry``), not raised."""

    def __init__(self, ft: FaultTolerance, rnd: Round) -> None:
        self.ft, self.rnd = ft, rnd

    def report(self, row: torch.Tensor) -> Optional[torch.Tensor]:
        """Every member's ``row`` in member order, as a table; ``None`` when the round failed (recorded)."""
        rows = self.ft.allgather(row.cpu())
        return None if rows is None else torch.stack(rows)

    def average(self, delta: torch.Tensor) -> int:
        """Weighted float32 allreduce of ``delta`` in place; return the bytes this member sent."""
        self.ft.allreduce(delta)
        return float32_allreduce_bytes(delta.numel(), self.rnd.size)

    @torch.no_grad()
    def compressed_average(self, fragment: Any, codec: str, block_size: int, error_feedback: bool) -> int:
        """Encode ``fragment.delta`` (plus this member's residual) once, all-gather the wires, and decode-sum them
        in member order into ``fragment.delta``; return the bytes this member sent (0 when the round failed)."""
        rnd, delta = self.rnd, fragment.delta
        ws = None
        if error_feedback and not rnd.healed:
            if not isinstance(fragment.workspace, MemberResiduals):
                fragment.workspace = MemberResiduals()
            ws = fragment.workspace
            ws.candidate = None
        flat = delta.detach().reshape(-1).float().cpu()
        if rnd.weights[rnd.rank] == 0:  # a healed member (or one without samples) adds nothing
            x = torch.zeros_like(flat)
        elif ws is not None:
            residual = ws.residual if ws.residual is not None else torch.zeros_like(delta)
            x = flat + residual.reshape(-1).cpu()
        else:
            x = flat
        n = x.numel()
        # every member decodes the same wires in member order: the same average, bit for bit
        weights = self.ft.screen(x)  # a contribution not finite or far too large: left out, on every member
        if weights is None:
            return 0
        averaged = allgather_average(x, codec, self.ft.allgather, block_size,
                                     weights=None if weights == rnd.weights and rnd.equal_weights() else weights)
        if averaged is None:
            return 0
        out, wire = averaged
        left_out = weights[rnd.rank] == 0 < rnd.weights[rnd.rank]  # by the screen: its residual stays (no NaN)
        if ws is not None and not left_out:
            device = ws.residual.device if ws.residual is not None else delta.device
            ws.candidate = (x - decode(wire, n, codec, block_size)).to(device)
        delta.copy_(out.view_as(delta))
        return wire_bytes(n, codec, block_size, rnd.size)
