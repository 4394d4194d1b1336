"""The collectives of a fault-tolerant round: over exactly its members, weighted, screened, errors recorded.

:class:`MemberCollectives` is the part of :class:`~bagua.torch_api.fault.replica.FaultTolerance` that runs a
round's collectives on its gloo group (:mod:`~bagua.torch_api.fault.group`): :meth:`~MemberCollectives.allreduce`
(weighted by the samples each member contributed, a healed member adding zeros),
:meth:`~MemberCollectives.allgather`, and :meth:`~MemberCollectives.screen`, which leaves out a contribution that is
not finite or far too large on every member alike (:mod:`~bagua.torch_api.fault.screen`); with ``robust=``, the
allreduce is a coordinate-wise median or trimmed mean over an all-gather (:mod:`~bagua.torch_api.fault.robust`).
An error is recorded through ``fail`` (the round's verdict is then ``retry``), never raised.

Example:
    >>> rnd = ft.start_round(rounds, part=0)  # doctest: +SKIP
    >>> ft.allreduce(delta)  # the weighted average over the members kept, in place  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Callable, Optional

import torch

from bagua.torch_api.fault.records import Round
from bagua.torch_api.fault.robust import kept_rows, robust_average
from bagua.torch_api.fault.screen import gather_norms, kept_average, screen, slotted_average

__all__ = ["ROUND_ERRORS", "MemberCollectives"]

_log = logging.getLogger(__name__)
#: what a round's collectives and transfers raise when a peer dies or stalls: recorded, and the round retried
ROUND_ERRORS = (RuntimeError, ValueError, TimeoutError, OSError)


class MemberCollectives:
    """A round's collectives over its members (mixed into :class:`~bagua.torch_api.fault.replica.FaultTolerance`,
    which sets the attributes below)."""

    worker: str
    max_norm_ratio: Optional[float]
    robust: Optional[str]
    trim: int
    dropped: list[tuple[int, str, str]]
    _round: Optional[Round]
    _error: Optional[BaseException]
    _groups: Any

    def fail(self, exc: BaseException) -> None:  # pragma: no cover - FaultTolerance's
        raise NotImplementedError

    def _exchange_timeout(self) -> float:  # pragma: no cover - FaultTolerance's
        raise NotImplementedError

    @torch.no_grad()
    def screen(self, tensor: torch.Tensor) -> Optional[tuple[int, ...]]:
        """The round's weights for ``tensor`` (this member's contribution to a collective): the members whose
        contribution is not finite, or far too large, at 0 (see :mod:`~bagua.torch_api.fault.screen`), each named
        in a warning; every member gets the same answer (from all-gathered norms). ``None`` after an error, which
        is recorded (see :meth:`should_commit`), not raised."""
        r = self._round
        if r is None or self._error is not None:
            return None
        try:
            norms = gather_norms(self._groups.group, tensor, r.size, self._exchange_timeout())
        except ROUND_ERRORS as exc:
            self.fail(exc)
            return None
        kept, why = screen(norms, r.weights, self.max_norm_ratio)
        self._name_left_out(r, kept, why)
        return tuple(kept)

    def _name_left_out(self, r: Round, kept: list[int], why: dict[int, str]) -> None:
        for i, reason in sorted(why.items()):
            worker = r.quorum.members[i].id
            self.dropped.append((r.quorum.key, worker, reason))
            _log.warning("worker %r is left out of quorum %d's average: %s; the round goes on with the %d others "
                         "kept", worker, r.quorum.key, reason, sum(1 for w in kept if w))

    @torch.no_grad()
    def allreduce(self, tensor: torch.Tensor, refill: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """Average ``tensor`` over the round's members in place, weighted by their samples (a plain mean, bit for
        bit a float32 allreduce's, when the weights are equal); a healed member contributes zeros, and so does one
        left out by :meth:`screen` (the average is over the others). With ``robust``: the coordinate-wise median or
        trimmed mean of the sources kept, every source counting once. An error is recorded (see
        :meth:`should_commit`), not raised; after one, nothing is sent.

        ``refill``: the last ``members`` values of the CPU ``tensor`` are room for the screen, not data; without
        ``robust``, each member's norm then rides the average itself (one collective instead of two:
        :func:`~bagua.torch_api.fault.screen.slotted_average`), and ``refill(data)`` writes this member's
        contribution again when the screen leaves a member out."""
        r = self._round
        if r is None or self._error is not None:
            return
        if refill is not None and self.robust is None:
            try:
                if r.healed:
                    tensor[:-r.size].zero_()
                kept, why = slotted_average(self._groups.group, tensor, r.rank, r.weights, self.max_norm_ratio,
                                            datetime.timedelta(seconds=self._exchange_timeout()),
                                            (lambda data: data.zero_()) if r.healed else refill)
                self._name_left_out(r, kept, why)
            except ROUND_ERRORS as exc:
                self.fail(exc)
            return
        if refill is not None:
            tensor = tensor[:-r.size]
        try:
            buf = tensor if tensor.device.type == "cpu" else tensor.cpu()
            timeout = datetime.timedelta(seconds=self._exchange_timeout())
            if r.healed:
                buf.zero_()
            weights = self.screen(buf)
            if weights is None:
                return
            if self.robust is not None:  # every member's tensor, then the same robust statistic on every member
                gathered = [torch.empty_like(buf) for _ in range(r.size)]
                self._groups.group.allgather([gathered], [buf]).wait(timeout)
                if any(weights):
                    buf.copy_(robust_average(kept_rows(gathered, weights), self.robust, self.trim).view_as(buf))
                else:
                    buf.zero_()
            elif weights == r.weights and r.equal_weights():
                self._groups.group.allreduce([buf]).wait(timeout)
                buf.div_(r.size)
            elif weights == r.weights:
                buf.mul_(r.weights[r.rank] / max(1, sum(r.weights)))
                self._groups.group.allreduce([buf]).wait(timeout)
            else:
                kept_average(self._groups.group, buf, r.rank, weights, timeout)
            if buf is not tensor:
                tensor.copy_(buf)
        except ROUND_ERRORS as exc:
            self.fail(exc)

    def allgather(self, tensor: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Every member's ``tensor`` (a CPU tensor of the same shape on every member), in member order; ``None``
        after an error, which is recorded (see :meth:`should_commit`), not raised."""
        r = self._round
        if r is None or self._error is not None:
            return None
        try:
            out = [torch.empty_like(tensor) for _ in range(r.size)]
            self._groups.group.allgather([out], [tensor]).wait(datetime.timedelta(seconds=self._exchange_timeout()))
            return out
        except ROUND_ERRORS as exc:
            self.fail(exc)
            return None
