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
   or at its deadline with at least ``min_quorum`` members. A worker is live while its heartbeat (a counter a
   thread of its own advances every ``heartbeat_s``) moves: a killed or stopped worker stops counting and is not
   waited for after ``stale_s``. The other members block on one key, the lead's bell, which it rings once the
   quorum is closed; a lead that dies is taken over by another member after ``stale_s``;
3. after the exchange each member reports ``ok`` or ``failed``; the verdict is written once (``compare_set``
   again): ``retry`` at once by a member that failed, ``ok`` by the last member to report, or by the lead when a
   member stopped beating without reporting; the survivors of a ``retry`` run the round again in the next quorum.

Each member thus makes a few store calls per round, and only the lead reads every slot: the coordinator's work
grows with the number of workers, not with its square (see "How far one coordinator goes" in
docs/fault_tolerance.md).

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
import dataclasses
import logging
import statistics
import threading
import time
import uuid
from typing import Any, Optional

import torch.distributed as dist

from bagua.torch_api.fault.admission import Admission
from bagua.torch_api.fault.lead import Heartbeat, Lead
from bagua.torch_api.fault.records import Member, Quorum
from bagua.torch_api.fault.secret import Records
from bagua.torch_api.fault.store import connect_store

__all__ = ["Quorums", "Excluded", "CoordinatorLost", "JobEnded", "connect_store"]

_log = logging.getLogger(__name__)

_POLL_S = 0.02  # the store is polled every 2 ms for the first 0.2 s of a wait (a round's usual case), then 20 ms


def _pause(start: float) -> None:
    time.sleep(0.002 if time.monotonic() - start < 0.2 else _POLL_S)


class Excluded(Exception):
    """This worker's quorum closed without it: its state is stale, it must join again."""


class CoordinatorLost(RuntimeError):
    """The coordinator's store stopped answering (it died, or the network to it is down)."""


class JobEnded(RuntimeError):
    """A joining worker found every other worker of the job finished (each closed its ``FaultTolerance``): a joiner
    alone never closes a round, so there is nothing to join."""


class Quorums(Admission):
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
        self._live: tuple[int, float, set[str]] = (0, 0.0, set())  # the lead's last read: quorum, when, who was live
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
        if not self._waited:
            self._waited = True
            self._bury_predecessor(key)
        slot = self.store.add(self._k(f"q/{key}/n"), 1)
        self._set(f"q/{key}/slot/{slot}", me.to_json())
        start = time.monotonic()
        if not me.joining:
            self._arrivals = (self._arrivals + [start])[-8:]
        # no round succeeded yet: the job's start waits for every worker (a worker that saw one knows it)
        first = self.previous is None and self._get("started") is None
        lead = self._take_lead(key) if not me.joining or first else None
        checked, rang = start, None
        while True:
            if lead is not None and not self._mine(lead):  # a follower: its bell first, then the record
                if rang not in (None, "dead"):
                    _pause(start)  # woken, yet nothing to read: junk on the bell; poll
                rang = self._follow(key, "closed", lead, start + self.timeout_s)
                if rang == "dead":
                    lead = self._take_lead(key, lead.raw)
            quorum = self._parse(f"q/{key}/closed", self._get(f"q/{key}/closed"), Quorum.from_json)
            if quorum is not None:
                self._lead_of = (key, lead)
                if self._mine(lead):
                    self._ring(key, "closed", lead, "closed")
                if self.worker not in quorum.ids:
                    self._raise_if_refused(key)
                    raise Excluded(f"worker {self.worker!r}: quorum {key} closed without it")
                return quorum
            if lead is not None and self._mine(lead):
                if self._maybe_close(key, start, first):
                    continue
                _pause(start)
            elif lead is None:
                if time.monotonic() - checked > 1.0:  # a joiner alone: has the job ended? (once a second)
                    checked = time.monotonic()
                    self._raise_if_ended(key)
                _pause(start)
            if time.monotonic() - start > self.timeout_s:
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

    def _live_now(self, key: int, arrived: set[str]) -> set[str]:
        """Who is live, for the lead of quorum ``key``: the heartbeats of the registered workers not in ``arrived``
        (which only grows within a quorum), read again at most every quarter ``heartbeat_s`` (a beat moves once per
        ``heartbeat_s``)."""
        at, when, live = self._live
        if at != key or time.monotonic() - when >= self.heartbeat.period_s / 4:
            live = self.live(among=set(self.registered()) - arrived)
            self._live = (key, time.monotonic(), live)
        return live

    def _maybe_close(self, key: int, start: float, first: bool) -> bool:
        """Close quorum ``key`` if it is ready (see the module docstring); return whether it closed."""
        arrived = self._bounded(self._arrived(key), key)
        ids = {m.id for m in arrived}
        if first:
            ready = len(ids) >= self.workers
        else:
            enough = len(ids) >= self.min_quorum and any(not m.joining for m in arrived)
            ready = enough and (self._live_now(key, ids) <= ids or time.monotonic() - start >= self.deadline())
        if not ready:
            return False
        prev = self.previous
        # the last round's group serves again when it succeeded just before with the same members: the same
        # processes, not only the same ids (a worker restarted at once keeps its id, and has no such group)
        same = prev is not None and prev.key == key - 1 and [
            (m.id, m.incarnation) for m in prev.members] == [(m.id, m.incarnation) for m in arrived]
        record = Quorum(key=key, members=tuple(arrived), epoch=prev.epoch if same else key, first=first)
        closed = self._parse(f"q/{key}/closed", self._claim(f"q/{key}/closed", record.to_json()), Quorum.from_json)
        if closed is not None:
            self._admit(closed.ids)
        self._claim("latest", str(key), forward=True)  # only ever forward
        return True

    # -- the verdict of a round --------------------------------------------------------------------------------

    def _report(self, quorum: Quorum, ok: bool) -> bool:
        """Report this member's exchange as ``ok`` or failed and return the round's verdict (True: everyone
        alive holds the result; False: the survivors retry in the next quorum). A failed member writes ``retry``,
        the last to report judges at once; the others wait on the lead's bell, and the lead judges a member that
        never reports (dead after ``stale_s``)."""
        key, ids = quorum.key, quorum.ids
        self._set(f"q/{key}/done/{self.worker}", "ok" if ok else "failed")
        reported = int(self.store.add(self._k(f"q/{key}/reported"), 1))
        known, lead = self._lead_of
        if known != key or lead is None or lead.id not in ids:
            lead = self._read_lead(key)
        if lead is None or lead.id not in ids:  # none (its record failed), or not a member: a member leads
            lead = self._take_lead(key, lead.raw if lead is not None else "")
        if not ok:
            self._decide(key, "retry", lead)
        elif reported >= len(ids):
            self._judge(quorum, lead)
        start = checked = time.monotonic()
        rang = None
        while True:
            if not self._mine(lead):  # a follower: its bell first, then the verdict
                if rang not in (None, "dead"):
                    _pause(start)  # woken, yet nothing to read: junk on the bell; poll
                rang = self._follow(key, "verdict", lead, start + self.timeout_s)
                if rang == "dead":
                    lead = self._take_lead(key, lead.raw)
            verdict = self._get(f"q/{key}/verdict")
            if verdict is not None:
                if self._mine(lead):
                    self._ring(key, "verdict", lead, verdict)
                self.next_key = key + 1
                if verdict == "ok":
                    self.previous = quorum
                return verdict == "ok"
            if self._mine(lead):
                if time.monotonic() - checked >= self.heartbeat.period_s / 2:
                    checked = time.monotonic()
                    self._judge(quorum, lead)
                _pause(start)
            if time.monotonic() - start > self.timeout_s:
                raise TimeoutError(f"worker {self.worker!r}: no verdict on quorum {key} within {self.timeout_s:g} s")

    def _judge(self, quorum: Quorum, lead: Lead) -> None:
        """Write the verdict if it is known: ``retry`` when a member failed, ``ok`` when every member reported
        ``ok`` or stopped beating."""
        done = dict(zip(quorum.ids, self._read([self._k(f"q/{quorum.key}/done/{w}") for w in quorum.ids])))
        if any(v == "failed" for v in done.values()):
            self._decide(quorum.key, "retry", lead)
            return
        missing = {w for w, v in done.items() if v is None}
        if not missing or not self.live(among=missing) & missing:
            self._decide(quorum.key, "ok", lead)

    def _decide(self, key: int, verdict: str, lead: Lead) -> None:
        """Claim ``verdict`` for quorum ``key`` (the first claimed stays) and ring the lead's bell."""
        stays = self._claim(f"q/{key}/verdict", verdict)
        if stays == verdict == "ok":
            self._set("started", "1")
        self._ring(key, "verdict", lead, stays)

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
