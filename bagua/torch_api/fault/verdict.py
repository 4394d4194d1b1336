"""The verdict of a round, and forgetting a round's records once every member is past it.

After its exchange each member of a quorum reports (:meth:`Verdicts._report`): it writes ``done/<id>`` (``ok`` or
``failed``) and adds to the round's report counter, 1 for ``ok`` and ``2**32`` for ``failed``, so that one ``add``
tells a member both how many reported ``ok`` and whether one failed. The verdict is then written once:

- ``retry`` at once by a member that failed (``compare_set``: the first verdict stays);
- ``ok`` by the member whose ``add`` counts every member ``ok``, without reading their reports;
- by the lead, when a member stopped beating without reporting (it reads the ``done`` records then).

The verdict rides the lead's bell (:mod:`~bagua.torch_api.fault.lead`), so a waiting member reads it there (one
round trip once woken); the lead itself waits on its own bell and judges a silent member every half heartbeat. In a
job with a secret the counter's key is derived from it: a process without the secret cannot count for a member.

Each worker deletes what it wrote ``FORGET_AFTER`` quorums ago (its slots and reports; a lead also the round's
records: the slot counter, lead, closed quorum, bells and verdict) on its heartbeat thread, off the training
thread's path: the coordinator's memory stays bounded by the last rounds' records, plus the few a worker that died
mid-round leaves behind. A member stalled so long that its round's records are gone finds a later quorum closed
and joins again (its state is stale): a deleted quorum is never closed a second time.

Example:
    >>> ok = quorums.report(quorum, ok=True)  # True: commit the round; False: run it again  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import time
from typing import Optional

from bagua.torch_api.fault.admission import Admission
from bagua.torch_api.fault.lead import Lead
from bagua.torch_api.fault.records import Quorum
from bagua.torch_api.fault.secret import derive

__all__ = ["Verdicts", "FORGET_AFTER", "FAILED"]

#: a worker deletes its records of a quorum once it is this many quorums past it
FORGET_AFTER = 8
#: what a member that failed adds to the round's report counter (one that succeeded adds 1)
FAILED = 1 << 32
_RECHECK_S = 5.0  # a member waiting on a bell looks every this often whether its round's records are gone


def _pause(start: float) -> None:
    time.sleep(0.002 if time.monotonic() - start < 0.2 else 0.02)


class Verdicts(Admission):
    """Report a round and learn its verdict; forget old rounds (the attributes a subclass sets: ``timeout_s``,
    ``next_key``, ``previous``, ``_lead_of``, ``_to_forget``, ``_started``, and :class:`Admission`'s own).

    Example:
        >>> quorums.report(quorum, True)  # doctest: +SKIP
        True
    """

    timeout_s: float
    next_key: int
    previous: Optional[Quorum]
    _lead_of: tuple[int, Optional[Lead]]
    _to_forget: collections.deque
    _started: bool

    def live(self, among: Optional[set[str]] = None) -> set[str]:  # pragma: no cover - Quorums'
        raise NotImplementedError

    def _reported_key(self, key: int) -> str:
        """The round's report counter (its name derived from the secret in a job with one)."""
        secret = self.records.secret
        tag = "" if secret is None else "/" + derive(secret, f"reported/{self.prefix}/{key}").hex()[:16]
        return self._k(f"q/{key}/reported{tag}")

    def _report(self, quorum: Quorum, ok: bool) -> bool:
        """Report this member's exchange as ``ok`` or failed and return the round's verdict (True: everyone
        alive holds the result; False: the survivors retry in the next quorum); see the module docstring."""
        key, ids = quorum.key, quorum.ids
        self._set(f"q/{key}/done/{self.worker}", "ok" if ok else "failed")
        count = int(self.store.add(self._reported_key(key), 1 if ok else FAILED))
        self._forget_at(key, [self._k(f"q/{key}/done/{self.worker}")])
        known, lead = self._lead_of
        if known != key or lead is None or lead.id not in ids:
            lead = self._read_lead(key)
        if lead is None or lead.id not in ids:  # none (its record failed), or not a member: a member leads
            lead = self._take_lead(key, lead.raw if lead is not None else "")
        verdict: Optional[str] = None
        if not ok:
            verdict = self._decide(key, "retry", lead)
        elif count % FAILED >= len(ids):  # every member reported ok: judged without reading their reports
            verdict = self._decide(key, "ok", lead)
        start = checked = time.monotonic()
        rang = None
        while verdict is None:
            mine = self._mine(lead)
            if rang not in (None, "dead", "timeout"):
                _pause(start)  # woken, yet nothing to read: junk on the bell; poll
            until = checked + self.heartbeat.period_s / 2 if mine else time.monotonic() + _RECHECK_S
            rang = self._follow(key, "verdict", lead, min(until, start + self.timeout_s))
            if rang in ("ok", "retry"):
                verdict = rang
                break
            if rang == "dead":
                lead = self._take_lead(key, lead.raw)
            verdict = self._peek(f"q/{key}/verdict")
            if verdict is None and self._mine(lead) and time.monotonic() - checked >= self.heartbeat.period_s / 2:
                checked = time.monotonic()
                verdict = self._judge(quorum, lead)
            if verdict is None and rang == "timeout" and self._gone(key):
                verdict = "retry"  # stalled until its round's records were deleted: run it again (it then joins)
            if verdict is None and time.monotonic() - start > self.timeout_s:
                raise TimeoutError(f"worker {self.worker!r}: no verdict on quorum {key} within {self.timeout_s:g} s")
        if self._mine(lead) and rang not in ("ok", "retry"):
            self._ring(key, "verdict", lead, verdict)  # wake who waits here (a verdict written on another's bell)
        if verdict == "ok" and not self._started:
            self._set("started", "1")
            self._started = True
        self.next_key = key + 1
        if verdict == "ok":
            self.previous = quorum
        if self._mine(lead):  # the lead forgets the round's own records
            self._forget_at(key, [self._k(f"q/{key}/{k}") for k in (
                "n", "lead", "closed", "verdict", f"bell/closed/{lead.incarnation}",
                f"bell/verdict/{lead.incarnation}")] + [self._reported_key(key)])
        return verdict == "ok"

    def _judge(self, quorum: Quorum, lead: Lead) -> Optional[str]:
        """Write the verdict if it is known (and return the one that stays): ``retry`` when a member failed, ``ok``
        when every member reported ``ok`` or stopped beating."""
        done = dict(zip(quorum.ids, self._read([self._k(f"q/{quorum.key}/done/{w}") for w in quorum.ids])))
        if any(v == "failed" for v in done.values()):
            return self._decide(quorum.key, "retry", lead)
        missing = {w for w, v in done.items() if v is None}
        if not missing or not self.live(among=missing) & missing:
            return self._decide(quorum.key, "ok", lead)
        return None

    def _decide(self, key: int, verdict: str, lead: Lead) -> str:
        """Claim ``verdict`` for quorum ``key`` (the first claimed stays), ring the lead's bell with the one that
        stays and return it."""
        stays = self._claim(f"q/{key}/verdict", verdict)
        self._ring(key, "verdict", lead, stays)
        return stays

    def _gone(self, key: int) -> bool:
        """Whether quorum ``key`` closed and its records were deleted since (a later quorum closed; rare: a member
        stalled past many rounds)."""
        latest = self._parse("latest", self._peek("latest"), int)
        return latest is not None and latest >= key and self._peek(f"q/{key}/closed") is None

    def _forget_at(self, key: int, keys: list[str]) -> None:
        """Delete the full ``keys`` (of quorum ``key``) once this worker is :data:`FORGET_AFTER` quorums past it."""
        self._to_forget.append((key, keys))

    def _sweep(self, key: int) -> None:
        """Hand the heartbeat thread what this worker wrote :data:`FORGET_AFTER` quorums before ``key``."""
        while self._to_forget and self._to_forget[0][0] <= key - FORGET_AFTER:
            self.heartbeat.forget(self._to_forget.popleft()[1])
