"""Who takes part in a synchronization: a quorum per round, agreed through torch's ``TCPStore``.

Workers that may fail alone are separate jobs with no torch world in common. They meet in a ``TCPStore`` served by
the coordinator (:mod:`~bagua.torch_api.fault.coordinator`), and at each synchronization agree on the members of
that round:

1. each arriving worker takes a slot in the quorum (``add`` on a counter) and writes who it is (a
   :class:`~bagua.torch_api.fault.records.Member` as JSON: id, round, whether it is joining, the samples it
   contributes);
2. the first member that may close it (a non-joining one; any, in the job's first quorum) takes its *lead*
   (:mod:`~bagua.torch_api.fault.lead`); the lead alone reads the slots and the heartbeats and closes the quorum, by
   ``compare_set`` on one key so that exactly one list of members wins, as soon as every live worker has arrived,
   or at its deadline with at least ``min_quorum`` members. The lead waits only for the members of the quorum
   before (the same processes: a restarted one is a joiner) that are live: a worker is live while its heartbeat (a
   counter a thread of its own advances every ``heartbeat_s``) moves, so a killed or stopped worker is not waited
   for after ``stale_s``; a worker not in that quorum (new, restarted, left out) is in the quorum if its slot is
   there when it closes, else in a later one, and never holds the others up. The lead blocks on the slot that
   completes the quorum, the other members on one key, the lead's bell, which it rings once the quorum is
   closed; a lead that dies is taken over by another member after ``stale_s``;
3. after the exchange each member reports ``ok`` or ``failed`` and learns the verdict, written once
   (:mod:`~bagua.torch_api.fault.verdict`); the survivors of a ``retry`` run the round again in the next quorum.

Each member thus makes a few store calls per round, and only the lead reads every slot: the coordinator's work
grows with the number of workers, not with its square, and its memory stays bounded: each worker deletes what it
wrote a few quorums back (see "How far one coordinator goes" in docs/fault_tolerance.md).

Quorums are numbered ``1, 2, ...``; the members of quorum ``k`` go on to ``k + 1`` (the next round or a retry), a
joiner to the one after the last closed. A worker that finds a quorum closed without it was left out: its state
is stale and it joins again. Nothing read from the store is unpickled: values are JSON or integers.

With a job secret (:mod:`~bagua.torch_api.fault.secret`) every record above is sealed with an HMAC bound to its
key, and a record that fails, or does not parse, is ignored with a warning: a slot written without the secret
never makes a member. The number of distinct workers ever admitted is bounded by ``max_workers`` (default
``workers``): the closer of a quorum leaves out a new id past it, and that worker raises
:class:`~bagua.torch_api.fault.secret.NotAdmitted`. Counters (the slots taken, heartbeats) carry no data and no
seal: a forged beat only makes the others wait for a worker until the deadline.

Example:
    >>> q = Quorums("10.0.0.1:29600", worker="site-a", workers=4)  # doctest: +SKIP
    >>> quorum = q.wait(q.next_key, Member(round=3, joining=False, samples=800, part=0))  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import datetime
import functools
import logging
import statistics
import threading
import time
import uuid
from typing import Any, Optional

import torch.distributed as dist

from bagua.torch_api.fault.lead import Heartbeat, Lead
from bagua.torch_api.fault.records import Member, Quorum
from bagua.torch_api.fault.secret import Records
from bagua.torch_api.fault.store import connect_store
from bagua.torch_api.fault.verdict import Verdicts

__all__ = ["Quorums", "Excluded", "CoordinatorLost", "JobEnded", "connect_store"]

_log = logging.getLogger(__name__)

_POLL_S = 0.02  # the store is polled every 2 ms for the first 0.2 s of a wait (a round's usual case), then 20 ms


def _pause(start: float) -> None:
    time.sleep(0.002 if time.monotonic() - start < 0.2 else _POLL_S)


@functools.lru_cache(maxsize=8)
def _quorum(payload: str) -> Quorum:
    """:meth:`Quorum.from_json`, once per process for one record (several workers as threads of one process, as in
    ``benchmarks.fault.quorum_load``, parse a closed quorum once; a quorum is immutable)."""
    return Quorum.from_json(payload)


class Excluded(Exception):
    """This worker's quorum closed without it: its state is stale, it must join again."""


class CoordinatorLost(RuntimeError):
    """The coordinator's store stopped answering (it died, or the network to it is down)."""


class JobEnded(RuntimeError):
    """A joining worker found every other worker of the job finished (each closed its ``FaultTolerance``): a joiner
    alone never closes a round, so there is nothing to join."""


class Quorums(Verdicts):
    """This worker's view of the job's quorums (see the module docstring).

    Args:
        coordinator: ``"host:port"`` of the coordinator's store.
        worker: this worker's id, unique in the job and the same after a restart (``"site-a"``); members are
            ordered by id, which fixes their ranks.
        workers: the job's number of workers, which the first quorum waits for.
        min_quorum: the fewest members a round goes on with; fewer wait (up to ``timeout_s``).
        deadline_s: how long a member waits for the live workers that have not arrived; ``None``: adaptive,
            ``slack`` times the median time between this worker's last rounds, at least ``min_deadline_s``.
        heartbeat_s, stale_s: a worker beats every ``heartbeat_s`` and counts as dead after ``stale_s`` without.
        timeout_s: the most any wait takes before it raises (the first quorum, a quorum below ``min_quorum``, a
            store that stopped answering).
        prefix: the job's keys in the store (several jobs may share one coordinator).
        secret: the job's secret (:func:`~bagua.torch_api.fault.secret.load_secret`); ``None``: an open job.
        max_workers: the most distinct worker ids the job ever admits (default ``workers``).
    """

    def __init__(self, coordinator: str, worker: str, workers: int, min_quorum: int = 1,
                 deadline_s: Optional[float] = None, min_deadline_s: float = 2.0, slack: float = 0.5,
                 heartbeat_s: float = 0.5, stale_s: float = 3.0, timeout_s: float = 300.0,
                 prefix: str = "bagua-ft", secret: Optional[bytes] = None,
                 max_workers: Optional[int] = None) -> None:
        if not worker or "/" in worker:
            raise ValueError(f"worker={worker!r} must be a non-empty id without '/', e.g. 'site-a'")
        if not 1 <= min_quorum <= workers:
            raise ValueError(f"min_quorum={min_quorum} must be between 1 and workers={workers}")
        if stale_s <= 2 * heartbeat_s:
            raise ValueError(f"stale_s={stale_s} must exceed twice heartbeat_s={heartbeat_s}")
        if max_workers is not None and max_workers < workers:
            raise ValueError(f"max_workers={max_workers} must be at least workers={workers} (or None: workers)")
        # user settings
        self.address, self.worker, self.workers, self.min_quorum = coordinator, worker, workers, min_quorum
        self.deadline_s, self.min_deadline_s, self.slack = deadline_s, min_deadline_s, slack
        self.stale_s, self.timeout_s, self.prefix = stale_s, timeout_s, prefix.rstrip("/")
        self.max_workers = max_workers if max_workers is not None else workers
        self.records = Records(secret, self.prefix)
        if secret is None:
            _log.warning("fault-tolerant job %r is open: any process that reaches the coordinator at %s can join it "
                         "and receive its state. Give every worker a job secret (`python -m "
                         "bagua.torch_api.fault.coordinator --new-secret PATH`, then BAGUA_JOB_SECRET_FILE=PATH)",
                         self.prefix, coordinator)
        # the store, this worker's registration and heartbeat
        self.incarnation = uuid.uuid4().hex[:16]  # this process: a restarted worker keeps its id, not this
        self.store = connect_store(coordinator, timeout_s, f"worker {worker!r}")
        self.store.delete_key(self._k(f"finished/{worker}"))  # a restarted worker takes part again
        self._set(f"process/{worker}", self.incarnation)  # a quorum's lead does not wait for an older process
        registration = self._k(f"workers/{self.store.add(self._k('workers/n'), 1)}")
        self.store.set(registration, self.records.seal(registration, worker))
        self.heartbeat = Heartbeat(coordinator, self._k(f"hb/{worker}"), heartbeat_s, stale_s, timeout_s)
        self.heartbeat.start()
        atexit.register(self.close)  # a worker that raises stops beating before the interpreter is torn down
        # internal state
        self.next_key = 0  # the quorum this worker takes part in next (0: not yet joined)
        self.previous: Optional[Quorum] = None  # the last quorum whose verdict was ok
        self._seen: dict[str, tuple[int, float]] = {}  # worker -> (heartbeat, when it last moved), as seen here
        self._arrivals: list[float] = []  # when this worker arrived at its last rounds
        self._known: set[str] = set()  # ids this worker saw admitted (they only grow): no store read for them
        self._registrations: dict[int, str] = {}  # registration number -> id, as read here (they never change)
        self._live: tuple[int, float, set[str]] = (0, 0.0, set())  # the lead's last read: quorum, when, waited for
        self._last: Optional[Quorum] = None  # the last quorum this worker was a member of
        self._to_forget: collections.deque = collections.deque()  # (quorum, full keys) this worker deletes later
        self._started = False  # whether this worker saw a round ok (and said so in the store)
        # the quorum whose slots were read here: (its key, slots not written yet, slots read, id -> (slot, member))
        self._arrived_at: tuple[int, list[int], int, dict[str, tuple[int, Member]]] = (0, [], 0, {})
        self._waited = False  # whether this process waited for a quorum yet
        self._lead_of: tuple[int, Optional[Lead]] = (0, None)  # the last quorum this worker saw closed, its lead

    # -- who is alive ------------------------------------------------------------------------------------------

    def registered(self) -> list[str]:
        """The ids of every worker that ever registered with the job (each registration read once)."""
        n = int(self.store.add(self._k("workers/n"), 0))
        new = [i for i in range(1, n + 1) if i not in self._registrations]
        for i, v in zip(new, self._read([self._k(f"workers/{i}") for i in new])):
            if v and "/" not in v:
                self._registrations[i] = v
        return sorted(set(self._registrations.values()))

    def live(self, among: Optional[set[str]] = None) -> set[str]:
        """The workers whose heartbeat moved within ``stale_s`` as seen from here (this worker always); ``among``:
        read only these workers' heartbeats (the others count as not live)."""
        now, alive = time.monotonic(), {self.worker}
        ids = [w for w in self.registered() if w != self.worker and (among is None or w in among)]
        beats = self.store.multi_get([self._k(f"hb/{w}") for w in ids]) if ids else []
        for w, raw in zip(ids, beats):
            value = self._parse(f"hb/{w}", raw.decode(errors="replace") or "0", int)
            if value is None:
                continue
            seen = self._seen.get(w)
            if seen is None or seen[0] != value:
                self._seen[w] = seen = (value, now)
            if now - seen[1] < self.stale_s:
                alive.add(w)
        return alive

    # -- a quorum ----------------------------------------------------------------------------------------------

    def latest(self) -> int:
        """The key of the last quorum that closed (0: none yet)."""
        value = self._parse("latest", self._guarded(self._get, "latest"), int)
        return value if value is not None else 0

    def deadline(self) -> float:
        """How long a member waits for live workers that have not arrived (see ``deadline_s``)."""
        if self.deadline_s is not None:
            return self.deadline_s
        gaps = [b - a for a, b in zip(self._arrivals, self._arrivals[1:])]
        return max(self.min_deadline_s, self.slack * statistics.median(gaps)) if gaps else self.min_deadline_s

    def wait(self, key: int, me: Member) -> Quorum:
        """Take a slot in quorum ``key``: see :meth:`_wait`; a lost coordinator raises :class:`CoordinatorLost`."""
        return self._guarded(self._wait, key, me)

    def report(self, quorum: Quorum, ok: bool) -> bool:
        """Report this member's exchange: see :meth:`_report`; a lost coordinator raises :class:`CoordinatorLost`."""
        return self._guarded(self._report, quorum, ok)

    def _guarded(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except dist.DistError as exc:
            raise CoordinatorLost(
                f"worker {self.worker!r}: the coordinator at {self.address} stopped answering ({exc}). Every worker "
                "stops here with its state intact: restart the coordinator, then the workers from their "
                "checkpoints") from exc

    def _wait(self, key: int, me: Member) -> Quorum:
        """Take a slot in quorum ``key`` as ``me`` (its ``id`` and ``incarnation`` filled in here) and return the
        closed quorum; raise :class:`Excluded` when it closed without this worker, ``TimeoutError`` past
        ``timeout_s``. The member that takes the quorum's lead closes it; the others wait on its bell (a joiner, who
        never closes a round, polls the one closed record, and once a second whether the job has ended)."""
        me = dataclasses.replace(me, id=self.worker, incarnation=self.incarnation)
        slot = self.store.add(self._k(f"q/{key}/n"), 1)
        self._set(f"q/{key}/slot/{slot}", me.to_json())
        if not self._waited:  # after the slot: a member that takes the dead lead over reads this process's slot
            self._waited = True
            self._bury_predecessor(key)
        self._forget_at(key, [self._k(f"q/{key}/slot/{slot}")])
        start = time.monotonic()
        if not me.joining:
            self._arrivals = (self._arrivals + [start])[-8:]
        # no round succeeded yet: the job's start waits for every worker (a worker that saw one knows it)
        first = self.previous is None and self._peek("started") is None
        lead = self._take_lead(key) if not me.joining or first else None
        self._sweep(key)
        checked, rang = start, None
        while True:
            quorum = None
            if lead is not None and not self._mine(lead):  # a follower: its bell first, then the record
                if rang not in (None, "dead", "timeout"):
                    _pause(start)  # woken, yet nothing to read: junk on the bell; poll
                rang = self._follow(key, "closed", lead, min(start + self.timeout_s, time.monotonic() + 5.0))
                if rang == "dead":
                    lead = self._take_lead(key, lead.raw)
            quorum = self._parse(f"q/{key}/closed", self._peek(f"q/{key}/closed"), _quorum)
            if quorum is None and rang == "timeout" and self._gone(key):
                raise Excluded(f"worker {self.worker!r}: quorum {key} closed long ago without it")
            if quorum is None and lead is not None and self._mine(lead):
                quorum = self._maybe_close(key, start, first)
            if quorum is not None:
                self._lead_of = (key, lead)
                if self._mine(lead):
                    self._ring(key, "closed", lead, "closed")
                    self._claim("latest", str(key), forward=True)  # only ever forward; joiners start after it
                if self.worker not in quorum.ids:
                    self._raise_if_refused(key)
                    raise Excluded(f"worker {self.worker!r}: quorum {key} closed without it")
                self._last = quorum
                return quorum
            if lead is None:
                if time.monotonic() - checked > 1.0:  # a joiner alone: has the job ended? (once a second)
                    checked = time.monotonic()
                    self._raise_if_ended(key)
                _pause(start)
            if time.monotonic() - start > self.timeout_s:
                if lead is None:
                    raise TimeoutError(
                        f"worker {self.worker!r} waited {self.timeout_s:g} s to join the job at quorum {key}, but no "
                        "member arrived to close it (a joining worker alone never closes a round): the other "
                        "workers stopped, or finished without closing their FaultTolerance (close() tells a "
                        "joiner the job ended). Restart them, or start a new job from a checkpoint")
                arrived = [m.id for m in self._arrived(key)]
                need = self.workers if first else self.min_quorum
                raise TimeoutError(
                    f"worker {self.worker!r}: quorum {key} did not close within {self.timeout_s:g} s: {arrived} "
                    f"arrived, {need} needed ({'the first quorum waits for every worker' if first else 'min_quorum'}); "
                    "start the missing workers, or lower min_quorum")

    def _raise_if_ended(self, key: int) -> None:
        """Raise :class:`JobEnded` when every other worker that registered has finished (see :meth:`close`)."""
        others = [w for w in self.registered() if w != self.worker]
        ends = self._read([self._k(f"finished/{w}") for w in others])
        ends = [self._parse(f"finished/{w}", e, int) for w, e in zip(others, ends)]
        if others and all(end is not None for end in ends):
            raise JobEnded(
                f"worker {self.worker!r}: the job has ended: every other worker ({', '.join(others)}) finished its "
                f"training and closed after quorum {max(int(e) for e in ends)} (this worker waited to join quorum "
                f"{key}). A joining worker alone never closes a round, so there is nothing to join: to train "
                "further, start a new job (another coordinator or prefix=) from a checkpoint")

    def _arrived(self, key: int) -> list[Member]:
        """The members that took a slot in quorum ``key`` so far, in id order (each slot read once here)."""
        at, pending, through, members = self._arrived_at
        if at != key:
            pending, through, members = [], 0, {}
        n = int(self.store.add(self._k(f"q/{key}/n"), 0))
        slots = pending + list(range(through + 1, n + 1))
        keys = [self._k(f"q/{key}/slot/{i}") for i in slots]
        written = slots if not keys or self.store.check(keys) else [
            i for i, k in zip(slots, keys) if self.store.check([k])]  # a slot taken, not yet written: next time
        values = self.store.multi_get([self._k(f"q/{key}/slot/{i}") for i in written]) if written else []
        for i, raw in zip(written, values):
            full = self._k(f"q/{key}/slot/{i}")
            m = self._parse(f"q/{key}/slot/{i}", self.records.open(full, raw.decode(errors="replace")),
                            Member.from_json)  # None: refused
            if m is not None and m.id and "/" not in m.id and i > members.get(m.id, (0, m))[0]:
                members[m.id] = (i, m)  # a worker that restarted within the quorum: its last slot
        self._arrived_at = (key, sorted(set(slots) - set(written)), max(through, n), members)
        return [members[w][1] for w in sorted(members)]

    def _waited_for(self, key: int, arrived: set[str]) -> set[str]:
        """The workers the lead of quorum ``key`` still waits for: the live members of quorum ``key - 1`` (the same
        processes) not in ``arrived``; without that quorum here, every live registered worker. Heartbeats are read
        again at most every quarter ``heartbeat_s`` (a beat moves once per ``heartbeat_s``)."""
        at, when, waited = self._live
        if at == key and time.monotonic() - when < self.heartbeat.period_s / 4:
            return waited - arrived
        last = self._last
        if last is None or last.key != key - 1:
            waited = self.live(among=set(self.registered()) - arrived)
        else:
            expected = {m.id: m.incarnation for m in last.members if m.id not in arrived}
            waited = self.live(among=set(expected)) & expected.keys() if expected else set()
            if waited:  # a worker restarted since (another process under its id) joins; it is not waited for
                ids = sorted(waited)
                now = self._read([self._k(f"process/{w}") for w in ids])
                waited = {w for w, p in zip(ids, now) if p is None or p == expected[w]}
        self._live = (key, time.monotonic(), waited)
        return waited - arrived

    def _maybe_close(self, key: int, start: float, first: bool) -> Optional[Quorum]:
        """Close quorum ``key`` if it is ready (see the module docstring) and return the quorum that stays; else
        block until the slot that would complete it is written, or the next look at the heartbeats, and return
        None."""
        arrived = self._bounded(self._arrived(key), key)
        ids = {m.id for m in arrived}
        now = time.monotonic()
        if first:
            missing, until = self.workers - len(ids), min(start + self.timeout_s, now + 5.0)
        else:
            waited = self._waited_for(key, ids)
            enough = len(ids) >= self.min_quorum and any(not m.joining for m in arrived)
            late = now - start >= self.deadline()
            missing = 0 if enough and (late or not waited) else max(1, len(waited))
            until = min(start + self.timeout_s, now + self.heartbeat.period_s,
                        start + self.deadline() if not late else now + self.heartbeat.period_s)
        if missing > 0:  # a slot taken but not written yet comes first (it is on its way)
            _, pending, through, _ = self._arrived_at
            self._await_slot(key, pending[0] if pending else through + missing, until)
            return None
        latest = None if first else self._parse("latest", self._peek("latest"), int)
        if latest is not None and latest >= key:  # it closed, and its records were deleted since: never again
            raise Excluded(f"worker {self.worker!r}: quorum {key} closed long ago without it")
        prev = self.previous
        # the last round's group serves again when it succeeded just before with the same members: the same
        # processes, not only the same ids (a worker restarted at once keeps its id, and has no such group)
        same = prev is not None and prev.key == key - 1 and [
            (m.id, m.incarnation) for m in prev.members] == [(m.id, m.incarnation) for m in arrived]
        record = Quorum(key=key, members=tuple(arrived), epoch=prev.epoch if same else key, first=first)
        closed = self._parse(f"q/{key}/closed", self._claim(f"q/{key}/closed", record.to_json()), Quorum.from_json)
        if closed is not None:
            self._admit(closed.ids)
        return closed

    def _await_slot(self, key: int, slot: int, until: float) -> None:
        """Block until slot ``slot`` of quorum ``key`` is written, or until the monotonic time ``until``."""
        left = until - time.monotonic()
        if left <= 0:
            return
        try:
            self.store.wait([self._k(f"q/{key}/slot/{slot}")], datetime.timedelta(seconds=left))
        except dist.DistStoreError as exc:
            if isinstance(exc, dist.DistNetworkError) or "timeout" not in str(exc).lower():
                raise

    def speak_for_worker(self) -> None:
        """Record this process as the worker's again: in a worker of several ranks every rank wrote its own at
        start, and the quorums' lead waits only for the process that is in the last quorum (the first rank's)."""
        self._set(f"process/{self.worker}", self.incarnation)

    def close(self, finished: bool = False) -> None:
        """Stop the heartbeat (the others then stop waiting for this worker after ``stale_s``); ``finished``: this
        worker's training is over (a joiner that then finds every other worker finished is told the job ended)."""
        if finished and not self.heartbeat.stopped.is_set():
            try:
                self._set(f"finished/{self.worker}", str(self.next_key - 1))
            except dist.DistError:
                pass  # the coordinator is gone: there is no job to tell
        self.heartbeat.stopped.set()
        if self.heartbeat.is_alive() and self.heartbeat is not threading.current_thread():
            self.heartbeat.join(timeout=2 * self.stale_s)
