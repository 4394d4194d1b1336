"""Who takes part in a synchronization: a quorum per round, agreed through torch's ``TCPStore``.

Workers that may fail alone are separate jobs with no torch world in common. They meet in a ``TCPStore`` served by
the coordinator (:mod:`~bagua.torch_api.fault.coordinator`), and at each synchronization agree on the members of
that round:

1. each arriving worker takes a slot in the quorum (``add`` on a counter) and writes who it is (a
   :class:`~bagua.torch_api.fault.records.Member` as JSON: id, round, whether it is joining, the samples it
   contributes);
2. a non-joining member closes the quorum, by ``compare_set`` on one key so that exactly one list of members wins,
   as soon as every live worker has arrived, or at its deadline with at least ``min_quorum`` members. A worker is
   live while its heartbeat (a counter a thread of its own advances every ``heartbeat_s``) moves: a killed or
   stopped worker stops counting and is not waited for after ``stale_s``;
3. after the exchange each member reports ``ok`` or ``failed``; one member writes the verdict (``compare_set``
   again): ``ok`` when no member failed and every member either reported or stopped beating, ``retry`` otherwise,
   and the survivors run the round again in the next quorum.

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
import datetime
import json
import logging
import statistics
import threading
import time
import uuid
from typing import Any, Optional

import torch.distributed as dist

from bagua.torch_api.fault.records import Member, Quorum
from bagua.torch_api.fault.secret import NotAdmitted, Records
from bagua.torch_api.fault.store import SealedKeys

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


def connect_store(address: str, timeout_s: float, what: str) -> dist.TCPStore:
    """A client of the coordinator's ``TCPStore`` at ``"host:port"``, with a clear error when it is not there."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{what}: coordinator={address!r} must be 'host:port', e.g. '10.0.0.1:29600'")
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, TimeoutError) as e:
        raise RuntimeError(f"{what}: no coordinator answers at {address} within {timeout_s:g} s; start one with "
                           f"`python -m bagua.torch_api.fault.coordinator --host {host} --port {port}` ({e})") from e


class _Heartbeat(threading.Thread):
    """Advance ``hb/<worker>`` every ``period_s`` on a store connection of its own, until stopped."""

    def __init__(self, address: str, key: str, period_s: float, timeout_s: float) -> None:
        super().__init__(name="bagua-ft-heartbeat", daemon=True)
        self.store = connect_store(address, timeout_s, "heartbeat")
        self.key, self.period_s = key, period_s
        self.stopped = threading.Event()
        self.store.add(key, 1)

    def run(self) -> None:
        beats = 1
        while not self.stopped.wait(self.period_s):
            beats += 1
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - junk written over the counter, or the coordinator is gone
                try:
                    self.store.set(self.key, str(beats))  # junk: beat again from a number
                except Exception:  # noqa: BLE001 - the coordinator is gone: the worker's next store call says so
                    return


class Quorums(SealedKeys):
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
        self.heartbeat = _Heartbeat(coordinator, self._k(f"hb/{worker}"), heartbeat_s, timeout_s)
        self.heartbeat.start()
        atexit.register(self.close)  # a worker that raises stops beating before the interpreter is torn down
        # internal state
        self.next_key = 0  # the quorum this worker takes part in next (0: not yet joined)
        self.previous: Optional[Quorum] = None  # the last quorum whose verdict was ok
        self._seen: dict[str, tuple[int, float]] = {}  # worker -> (heartbeat, when it last moved), as seen here
        self._arrivals: list[float] = []  # when this worker arrived at its last rounds
        self._known: set[str] = set()  # ids this worker saw admitted (they only grow): no store read for them

    # -- who is alive ------------------------------------------------------------------------------------------

    def registered(self) -> list[str]:
        """The ids of every worker that ever registered with the job."""
        n = int(self.store.add(self._k("workers/n"), 0))
        ids = self._read([self._k(f"workers/{i}") for i in range(1, n + 1)])
        return sorted({v for v in ids if v and "/" not in v})

    def live(self) -> set[str]:
        """The workers whose heartbeat moved within ``stale_s`` as seen from here (this worker always)."""
        now, alive = time.monotonic(), {self.worker}
        ids = self.registered()
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
        ``timeout_s``."""
        me = dataclasses.replace(me, id=self.worker, incarnation=self.incarnation)
        slot = self.store.add(self._k(f"q/{key}/n"), 1)
        self._set(f"q/{key}/slot/{slot}", me.to_json())
        start = time.monotonic()
        if not me.joining:
            self._arrivals = (self._arrivals + [start])[-8:]
        # no round succeeded yet: the job's start waits for every worker (a worker that saw one knows it)
        first = self.previous is None and self._get("started") is None
        checked = start
        while True:
            quorum = self._parse(f"q/{key}/closed", self._get(f"q/{key}/closed"), Quorum.from_json)
            if quorum is not None:
                if self.worker not in quorum.ids:
                    self._raise_if_refused(key)
                    raise Excluded(f"worker {self.worker!r}: quorum {key} closed without it")
                return quorum
            if not me.joining or first:
                self._maybe_close(key, start, first)
            elif time.monotonic() - checked > 1.0:  # a joiner alone: has the job ended? (once a second)
                checked = time.monotonic()
                self._raise_if_ended(key)
            if time.monotonic() - start > self.timeout_s:
                arrived = [m.id for m in self._arrived(key)]
                need = self.workers if first else self.min_quorum
                raise TimeoutError(
                    f"worker {self.worker!r}: quorum {key} did not close within {self.timeout_s:g} s: {arrived} "
                    f"arrived, {need} needed ({'the first quorum waits for every worker' if first else 'min_quorum'}); "
                    "start the missing workers, or lower min_quorum")
            _pause(start)

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

    def _raise_if_refused(self, key: int) -> None:
        """Raise :class:`NotAdmitted` when the job admitted ``max_workers`` distinct workers, this one not among
        them (a quorum closed without it)."""
        admitted = self._admitted()
        if self.worker not in admitted and len(admitted) >= self.max_workers:
            raise NotAdmitted(
                f"worker {self.worker!r}: the job already admitted max_workers={self.max_workers} distinct workers "
                f"({', '.join(sorted(admitted))}); quorum {key} closed without this one. Restart one of them under "
                "its own id, or start every worker with a larger max_workers= to allow more")

    def _admitted(self) -> set[str]:
        """The ids the job admitted to a quorum so far (a sealed JSON list)."""
        ids = self._parse("admitted", self._get("admitted"), json.loads)
        admitted = {str(w) for w in ids} if isinstance(ids, list) else set()
        self._known |= admitted
        return admitted

    def _admit(self, ids: list[str]) -> None:
        """Add ``ids`` to the job's admitted workers (a compare-and-set loop: concurrent closers merge)."""
        if set(ids) <= self._known:
            return
        full = self._k("admitted")
        for _ in range(16):
            raw = self._raw(full) if self.store.check([full]) else ""
            known = self._admitted() if raw else set()
            if set(ids) <= known:
                return
            merged = self.records.seal(full, json.dumps(sorted(known | set(ids))))
            if self.store.compare_set(full, raw, merged).decode(errors="replace") == merged:
                self._known |= known | set(ids)
                return

    def _arrived(self, key: int) -> list[Member]:
        n = int(self.store.add(self._k(f"q/{key}/n"), 0))
        members = {}
        for i, raw in enumerate(self._read([self._k(f"q/{key}/slot/{i}") for i in range(1, n + 1)]), start=1):
            m = self._parse(f"q/{key}/slot/{i}", raw, Member.from_json)  # None: a slot not written yet, or refused
            if m is not None and m.id and "/" not in m.id:
                members[m.id] = m  # a worker that restarted within the quorum: its last slot
        return [members[w] for w in sorted(members)]

    def _bounded(self, arrived: list[Member], key: int) -> list[Member]:
        """``arrived`` without the new ids past ``max_workers`` distinct workers (in id order), named in a
        warning."""
        if all(m.id in self._known for m in arrived):
            return arrived
        admitted = self._admitted()
        room = self.max_workers - len(admitted)
        new = [m.id for m in arrived if m.id not in admitted]
        refused = set(new[max(0, room):])
        if refused:
            _log.warning("quorum %d leaves out worker(s) %s: the job already admitted max_workers=%d distinct workers "
                         "(%s); start every worker with a larger max_workers= to allow more", key,
                         ", ".join(sorted(refused)), self.max_workers, ", ".join(sorted(admitted)))
        return [m for m in arrived if m.id not in refused]

    def _maybe_close(self, key: int, start: float, first: bool) -> None:
        arrived = self._bounded(self._arrived(key), key)
        ids = {m.id for m in arrived}
        if first:
            ready = len(ids) >= self.workers
        else:
            enough = len(ids) >= self.min_quorum and any(not m.joining for m in arrived)
            ready = enough and (self.live() <= ids or time.monotonic() - start >= self.deadline())
        if not ready:
            return
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

    # -- the verdict of a round --------------------------------------------------------------------------------

    def _report(self, quorum: Quorum, ok: bool) -> bool:
        """Report this member's exchange as ``ok`` or failed and return the round's verdict (True: everyone
        alive holds the result; False: the survivors retry in the next quorum)."""
        key = quorum.key
        self._set(f"q/{key}/done/{self.worker}", "ok" if ok else "failed")
        ids = quorum.ids
        start = time.monotonic()
        while True:
            verdict = self._get(f"q/{key}/verdict")
            if verdict is not None:
                self.next_key = key + 1
                if verdict == "ok":
                    self.previous = quorum
                    self._set("started", "1")
                return verdict == "ok"
            done = dict(zip(ids, self._read([self._k(f"q/{key}/done/{w}") for w in ids])))
            failed = any(v == "failed" for v in done.values())
            live = self.live()
            if failed or all(v is not None or w not in live for w, v in done.items()):
                self._claim(f"q/{key}/verdict", "retry" if failed else "ok")
                continue
            if time.monotonic() - start > self.timeout_s:
                raise TimeoutError(f"worker {self.worker!r}: no verdict on quorum {key} within {self.timeout_s:g} s")
            _pause(start)

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
