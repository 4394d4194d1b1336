"""One member decides a quorum, the others wait on one key: the lead of a quorum, its bells, and the heartbeat.

The quorum protocol (:mod:`~bagua.torch_api.fault.quorum`) costs the coordinator a few store calls per worker and
round, however many workers there are, because only one member reads the others' records:

- the *lead* of quorum ``k`` is the first member to ``compare_set`` the record ``q/<k>/lead`` (its id and process);
  it reads the slots and the heartbeats, closes the quorum, and judges the round's verdict when a member died;
- every other member blocks in ``store.wait`` on one *bell* of that lead, ``q/<k>/bell/<phase>/<process>``, which the
  lead (or whoever writes the record) rings with a sealed ``closed`` or ``verdict`` once the record is written;
- when the lead dies, its bell is rung ``dead``: by each follower's heartbeat thread once the lead's heartbeat has
  not moved for ``stale_s``, or at once by the lead's restarted process (same id, another process) when it arrives;
  the followers then take the lead over (``compare_set`` from the dead lead's record: one wins) and the round
  still closes.

Bells and leads are sealed like every other record (:class:`~bagua.torch_api.fault.secret.Records`): a bell rung or
a lead written without the job's secret is ignored with the usual warning (a follower then polls its one key), and
a lead record that fails is replaced.

Example:
    >>> lead = quorums._take_lead(7)  # quorum 7's lead: this worker, or who claimed it first  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import datetime
import json
import threading
import time
from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from bagua.torch_api.fault.store import SealedKeys, connect_store

__all__ = ["Heartbeat", "Lead", "Leads"]

_ABSENT = "\x00absent"  # what a one-round-trip read (compare_set with it on both sides) returns for no key


class Heartbeat(threading.Thread):
    """Advance ``key`` every ``period_s`` on a store connection of its own, until stopped; while :meth:`watch` names
    a lead, ring its bell once the lead's heartbeat has not moved for ``stale_s``; delete the keys handed to
    :meth:`forget` (a round's records, once every member is past it), off the training thread's path.

    Example:
        >>> beat = Heartbeat("10.0.0.1:29600", "job/hb/site-a", 0.5, 3.0, 60.0)  # doctest: +SKIP
        >>> beat.start(); beat.watch("job/hb/site-b", "job/q/7/bell/closed/ab12", "dead")  # doctest: +SKIP
    """

    def __init__(self, address: str, key: str, period_s: float, stale_s: float, timeout_s: float) -> None:
        super().__init__(name="bagua-ft-heartbeat", daemon=True)
        self.store = connect_store(address, timeout_s, "heartbeat")
        self.key, self.period_s, self.stale_s = key, period_s, stale_s
        self.stopped = threading.Event()
        self.watching: Optional[tuple[str, str, str]] = None  # (the lead's heartbeat key, its bell, the ring)
        self.forgotten: collections.deque[str] = collections.deque()  # full keys to delete, in order
        self.store.add(key, 1)

    def forget(self, keys: list[str]) -> None:
        """Delete the full ``keys`` at the next beat (on this thread's own connection)."""
        self.forgotten.extend(keys)

    def watch(self, heartbeat: Optional[str], bell: str = "", ring: str = "") -> None:
        """Watch the heartbeat under the full key ``heartbeat`` and set ``bell`` to ``ring`` when it stops (``None``:
        watch nothing)."""
        self.watching = (heartbeat, bell, ring) if heartbeat is not None else None

    def run(self) -> None:
        beats, seen = 1, None
        while not self.stopped.wait(self.period_s):
            beats += 1
            try:
                self.store.add(self.key, 1)
                seen = self._check(seen)
                while self.forgotten and not self.stopped.is_set():
                    self.store.delete_key(self.forgotten.popleft())
            except Exception:  # noqa: BLE001 - junk written over the counter, or the coordinator is gone
                try:
                    self.store.set(self.key, str(beats))  # junk: beat again from a number
                except Exception:  # noqa: BLE001 - the coordinator is gone: the worker's next store call says so
                    return

    def _check(self, seen: Optional[tuple[Any, bytes, float]]) -> Optional[tuple[Any, bytes, float]]:
        """One look at the watched heartbeat (its raw value: a counter, or junk that does not move either)."""
        watching = self.watching
        if watching is None:
            return None
        heartbeat, bell, ring = watching
        beat = self.store.get(heartbeat) if self.store.check([heartbeat]) else b""
        now = time.monotonic()
        if seen is None or seen[0] is not watching or seen[1] != beat:
            return (watching, beat, now)
        if now - seen[2] >= self.stale_s:
            self.store.set(bell, ring)
            if self.watching is watching:
                self.watching = None
            return None
        return seen


class Lead(NamedTuple):
    """The member that leads one quorum: its ``id``, its process (``incarnation``) and the ``raw`` record."""

    id: str
    incarnation: str
    raw: str


class Leads(SealedKeys):
    """Claim, follow and take over the lead of a quorum (the attributes a subclass sets: ``worker``,
    ``incarnation``, ``heartbeat``, and :class:`~bagua.torch_api.fault.store.SealedKeys`' own).

    Example:
        >>> lead = quorums._take_lead(7)  # doctest: +SKIP
        >>> rang = quorums._follow(7, "closed", lead, time.monotonic() + 60)  # a follower waits  # doctest: +SKIP
    """

    worker: str
    incarnation: str
    heartbeat: Heartbeat

    def _peek(self, key: str) -> Optional[str]:
        """The payload of the record under ``key`` in one round trip, without blocking (None: absent, or it fails
        its checks): a ``compare_set`` that never matches a real value (a ``get`` waits for the key first: two)."""
        return self._peek_full(self._k(key))

    def _peek_full(self, full: str) -> Optional[str]:
        raw = self.store.compare_set(full, _ABSENT, _ABSENT).decode(errors="replace")
        return None if raw == _ABSENT else self.records.open(full, raw)

    def _mine(self, lead: Optional[Lead]) -> bool:
        return lead is not None and (lead.id, lead.incarnation) == (self.worker, self.incarnation)

    def _parse_lead(self, key: int, raw: str) -> Optional[Lead]:
        if not raw:
            return None
        payload = self.records.open(self._k(f"q/{key}/lead"), raw)
        d = self._parse(f"q/{key}/lead", payload, json.loads)
        if not isinstance(d, dict) or not isinstance(d.get("id"), str) or not isinstance(d.get("incarnation"), str):
            return None
        return Lead(d["id"], d["incarnation"], raw)

    def _read_lead(self, key: int) -> Optional[Lead]:
        """The lead of quorum ``key`` (None: none yet, or its record fails)."""
        full = self._k(f"q/{key}/lead")
        raw = self.store.compare_set(full, _ABSENT, _ABSENT).decode(errors="replace")
        return self._parse_lead(key, "" if raw == _ABSENT else raw)

    def _take_lead(self, key: int, current: str = "") -> Lead:
        """Lead quorum ``key`` unless a valid lead other than ``current`` (the raw record of a dead lead; empty:
        none) holds it: one ``compare_set``, and one more per junk record replaced. Return the lead that stays."""
        full = self._k(f"q/{key}/lead")
        mine = self.records.seal(full, json.dumps({"id": self.worker, "incarnation": self.incarnation}))
        for _ in range(16):
            raw = self.store.compare_set(full, current, mine).decode(errors="replace")
            lead = self._parse_lead(key, raw)
            if lead is not None:
                return lead
            current = raw  # junk: replace it
        return Lead(self.worker, self.incarnation, mine)

    def _bell(self, key: int, phase: str, lead: Lead) -> str:
        return self._k(f"q/{key}/bell/{phase}/{lead.incarnation}")

    def _ring(self, key: int, phase: str, lead: Optional[Lead], what: str) -> None:
        """Wake the members that wait on ``lead``'s bell of ``phase`` (``closed``, ``verdict``) with ``what``."""
        if lead is not None:
            bell = self._bell(key, phase, lead)
            self.store.set(bell, self.records.seal(bell, what))

    def _follow(self, key: int, phase: str, lead: Lead, until: float) -> str:
        """Block until ``lead``'s bell of ``phase`` rings, or until the monotonic time ``until``; return what rang
        (the closed quorum's record, the verdict, ``dead``), ``timeout``, or ``""`` for a bell that fails its seal
        (poll instead). Meanwhile the heartbeat thread rings ``dead`` if the lead's heartbeat stops (not when this
        worker is the lead, waiting on its own bell)."""
        bell = self._bell(key, phase, lead)
        left = until - time.monotonic()
        if left <= 0:
            return "timeout"
        if not self._mine(lead):
            self.heartbeat.watch(self._k(f"hb/{lead.id}"), bell, self.records.seal(bell, "dead"))
        try:
            self.store.wait([bell], datetime.timedelta(seconds=left))
        except dist.DistStoreError as exc:
            if isinstance(exc, dist.DistNetworkError) or "timeout" not in str(exc).lower():
                raise
            return "timeout"
        finally:
            self.heartbeat.watch(None)
        return self._peek_full(bell) or ""

    def _bury_predecessor(self, key: int) -> None:
        """Ring ``dead`` for this worker's previous process where it led quorum ``key - 1`` or ``key`` (it died
        and was restarted under the same id, which keeps its heartbeat moving)."""
        for k in (key - 1, key):
            lead = self._read_lead(k) if k > 0 else None
            if lead is not None and lead.id == self.worker and lead.incarnation != self.incarnation:
                for phase in ("closed", "verdict"):
                    self._ring(k, phase, lead, "dead")
