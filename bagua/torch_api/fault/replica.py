"""Workers that fail alone: a communicator over whichever workers are alive, for any algorithm.

:class:`FaultTolerance` is what an algorithm takes as ``fault_tolerance=`` (``DiLoCoAlgorithm``,
``contrib.DiLoCoOptimizer``). Each worker is then a job of its own (one process, or the ranks of one sharded model,
started by ``torchrun`` or any launcher, which restarts it alone); the workers share no torch world. The algorithm
registers its state callbacks once (:meth:`FaultTolerance.register`), then runs each synchronization as a round:

1. :meth:`FaultTolerance.start_round`: the live workers agree on the round's members
   (:class:`~bagua.torch_api.fault.quorum.Quorums`; a worker that died or stalls past the deadline is left out),
   get a gloo group of exactly those members (the last one when they are the same), and a member that is joining
   (new, restarted, or left out of an earlier round) takes the state of a live peer through the algorithm's
   callbacks (:mod:`~bagua.torch_api.fault.heal`: checksummed, never unpickled). It returns a typed
   :class:`~bagua.torch_api.fault.records.Round`;
2. :meth:`FaultTolerance.allreduce` / :meth:`FaultTolerance.allgather` over exactly the members, weighted by the
   samples each contributed (a healed member contributes zeros; each claim bounded, and a contribution that is not
   finite or far too large left out and named: :mod:`~bagua.torch_api.fault.screen`); an error is recorded, not
   raised;
3. :meth:`FaultTolerance.should_commit`: the round's verdict. ``True``: every member holds the result, and the
   algorithm commits it (a healed member takes the round's outcome from it). ``False``: a peer died mid-way, and
   the survivors run the round again from what they held before it.

A worker may also be a job of several ranks holding the model sharded with FSDP2 (``with_bagua(...,
device_mesh=mesh)`` with a ``(1, shards)`` mesh): its first rank takes part in the quorum for it and shares it
with its other ranks (:mod:`~bagua.torch_api.fault.ranks`); each rank heals and averages its own shard with the
same shard's ranks of the other members, on a gloo group per shard; the worker's exchange is ``ok`` only when it
was on every shard, so a round is retried, or kept, for all shards at once.

Example:
    >>> ft = FaultTolerance("10.0.0.1:29600", worker="site-a", workers=4, min_quorum=2)  # doctest: +SKIP
    >>> opt = DiLoCoOptimizer(torch.optim.AdamW(model.parameters()), sync_every=100, fault_tolerance=ft)  # doctest: +SKIP
    >>> while opt.steps < total_steps:  # opt.steps is the job's step, also after a rejoin  # doctest: +SKIP
    ...     train_one_step(batch_for(opt.steps)); opt.step()
"""

from __future__ import annotations

import logging
import math
import socket
import statistics
import time
from typing import Callable, Optional

import torch

from bagua.torch_api.fault.collectives import ROUND_ERRORS, MemberCollectives
from bagua.torch_api.fault.group import MemberGroup
from bagua.torch_api.fault.heal import TAKE_INNER_STATE, heal_state, load_inner_state, serve_state
from bagua.torch_api.fault.quorum import Excluded, Quorums
from bagua.torch_api.fault.ranks import WorkerRanks
from bagua.torch_api.fault.records import Member, Quorum, Round, roles
from bagua.torch_api.fault.robust import ROBUST
from bagua.torch_api.fault.screen import MAX_NORM_RATIO, MAX_SAMPLE_RATIO, bound_samples
from bagua.torch_api.fault.secret import derive, load_secret

__all__ = ["FaultTolerance", "SettingsDiffer"]

_log = logging.getLogger(__name__)

StateDict = Callable[[], dict[str, torch.Tensor]]
LoadStateDict = Callable[[dict[str, torch.Tensor]], None]


def _route_to(address: str) -> str:
    """This machine's address on the route to ``host:port`` (what the gloo group binds to)."""
    host = address.rpartition(":")[0].strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet leaves: a datagram socket only picks its route
        return s.getsockname()[0]


class SettingsDiffer(ValueError):
    """The members of a round run the algorithm with different settings: the job cannot go on (never retried)."""


class FaultTolerance(MemberCollectives):
    """A communicator over whichever workers are alive (see the module docstring).

    Args:
        coordinator: ``"host:port"`` of the coordinator (``python -m bagua.torch_api.fault.coordinator``).
        worker: this worker's id, unique in the job and kept across its restarts (``"site-a"``).
        workers: the job's number of workers; the first round waits for all of them.
        min_quorum: the fewest workers a round goes on with (``workers``: always wait for everyone).
        deadline_s: how long the arrived workers wait for a live one that has not; ``None`` adapts it to half
            the measured time between rounds (at least 2 s).
        constant_batch: :meth:`accumulation` scales the steps a worker accumulates by ``workers / live``, so the
            job's global batch stays the same while workers are missing.
        exchange_timeout_s: the most a round's exchange (heal and collectives) may take before it fails and the
            round is retried without the workers that did not answer; ``None``: 4x the slowest exchange measured,
            at least 30 s.
        heartbeat_s, stale_s: heartbeat period, and the silence after which a worker is not waited for.
        timeout_s: the most a wait for the coordinator or a quorum takes before it raises.
        inner_state: also take a peer's inner optimizer state when healing (measured: no better; see
            docs/fault_tolerance.md).
        hostname: the address the worker's gloo groups bind to (default: this machine's address on the route to
            the coordinator).
        prefix: the job's keys in the coordinator's store (several jobs may share one).
        secret_file: the job's secret (``python -m bagua.torch_api.fault.coordinator --new-secret PATH``); default:
            the file ``BAGUA_JOB_SECRET_FILE`` names, else ``BAGUA_JOB_SECRET``, else none (an open job, warned).
        max_workers: the most distinct worker ids the job admits (default ``workers``).
        max_norm_ratio, max_sample_ratio: a contribution above ``max_norm_ratio`` times the round's median norm is
            left out (3+ sources; ``None``: only NaN/Inf ones), and a member's samples count at most
            ``max_sample_ratio`` times the median of the others' (``None``: unbounded); see
            :mod:`~bagua.torch_api.fault.screen`.
        robust: ``"median"`` or ``"trimmed_mean"`` (dropping ``trim`` values at each end): :meth:`allreduce` is
            that coordinate-wise statistic over an all-gather of the sources' tensors, so one lying worker cannot
            drag it far (:mod:`~bagua.torch_api.fault.robust`; ``None``: the weighted average).

    Attributes: ``members`` (the last round's), ``rounds``, ``retries``, ``heals`` (times this worker healed from
    a live peer; the job's first round, where every worker takes the first one's state, is the start, not a heal),
    ``served`` (times it sent its state to another, that first round included), ``left_out`` (times it found a
    round closed without it), ``exchange_seconds``, ``heal_seconds`` (the time of each state it took), ``dropped``
    (``(quorum, worker, why)`` of each contribution left out of a collective here).
    """

    def __init__(self, coordinator: str, worker: str, workers: int, min_quorum: int = 1,
                 deadline_s: Optional[float] = None, constant_batch: bool = False,
                 exchange_timeout_s: Optional[float] = None, heartbeat_s: float = 0.5, stale_s: float = 3.0,
                 timeout_s: float = 300.0, inner_state: bool = TAKE_INNER_STATE, hostname: Optional[str] = None,
                 prefix: str = "bagua-ft", secret_file: Optional[str] = None, max_workers: Optional[int] = None,
                 max_norm_ratio: Optional[float] = MAX_NORM_RATIO,
                 max_sample_ratio: Optional[float] = MAX_SAMPLE_RATIO, robust: Optional[str] = None,
                 trim: int = 1) -> None:
        if robust is not None and robust not in ROBUST:
            raise ValueError(f"robust={robust!r}; available: {', '.join(map(repr, ROBUST))}, or None (the average)")
        if trim < 1:
            raise ValueError(f"trim={trim} must be at least 1 (the values dropped at each end of a trimmed mean)")
        # user settings
        self.constant_batch = constant_batch
        self.max_norm_ratio, self.max_sample_ratio = max_norm_ratio, max_sample_ratio
        self.robust, self.trim = robust, trim
        self._secret = load_secret(secret_file)
        self.exchange_timeout_s = exchange_timeout_s
        self.inner_state = inner_state
        self.quorums = Quorums(coordinator, worker, workers, min_quorum, deadline_s, heartbeat_s=heartbeat_s,
                               stale_s=stale_s, timeout_s=timeout_s, prefix=prefix, secret=self._secret,
                               max_workers=max_workers)
        self.hostname = hostname or _route_to(coordinator)
        #: a worker of several ranks (a sharded model): its ranks, set by :meth:`bind_ranks`; None: one process
        self.ranks: Optional[WorkerRanks] = None
        # what the algorithm registered (see register)
        self._settings = ""
        self._needs = "the same settings"
        self._state_dict: Optional[StateDict] = None
        self._load_state_dict: Optional[LoadStateDict] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None  # the inner optimizer, whose state heals too
        # internal state
        self._groups = MemberGroup(self.quorums.store, self.quorums.prefix, self.hostname)
        self._joining = True  # a worker joins the job before its first round (and again when left out)
        self._round: Optional[Round] = None  # the round in progress
        self._error: Optional[BaseException] = None  # what its collectives raised, recorded
        self._started = 0.0
        self._samples: dict[int, int] = {}  # part -> samples since its last synchronization
        self._step_samples: Optional[int] = None
        #: set by a synchronous job from a step's first forward (its samples counted as its agreement starts) to
        #: the end of its backward: samples added then would silently count towards the next step
        self.step_counted = False
        # stats
        self.members: list[str] = []
        self.rounds = self.retries = self.heals = self.served = self.left_out = 0
        self.exchange_seconds: list[float] = []
        self.heal_seconds: list[float] = []
        self.dropped: list[tuple[int, str, str]] = []

    @property
    def worker(self) -> str:
        """This worker's id."""
        return self.quorums.worker

    @property
    def workers(self) -> int:
        """The job's number of workers."""
        return self.quorums.workers

    def bind_ranks(self, ranks: list[int]) -> None:
        """Make this process one of the ``ranks`` (global ranks of this worker's torch world) of a worker whose
        model is sharded over them; collective over that world. The first rank speaks for the worker to the
        coordinator, the others stop their heartbeat and follow it; each exchanges its own shard (see
        :mod:`~bagua.torch_api.fault.ranks`). ``with_bagua(..., device_mesh=...)`` calls it."""
        if self.ranks is not None or len(ranks) < 2:
            return
        # the first rank's waits on the coordinator bound how long the others wait for it
        self.ranks = WorkerRanks(ranks, timeout_s=2 * self.quorums.timeout_s + 60.0)
        if self.ranks.rank != 0:
            self.quorums.close()
        else:  # after every rank's start (the group above is collective): the first rank is the worker's process
            self.quorums.speak_for_worker()

    def register(self, state_dict: StateDict, load_state_dict: LoadStateDict, settings: str,
                 needs: str = "the same settings", optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Register what a joining worker takes from a live peer, and what every member must share.

        Args:
            state_dict: returns the algorithm's state a joiner takes (flat tensors; the same on every member).
            load_state_dict: loads it on the joiner (and starts the joiner's per-worker state empty).
            settings: the algorithm's settings as text; a round whose members differ raises
                :class:`SettingsDiffer`, whose message says the workers need ``needs``.
            optimizer: the inner optimizer, whose ``param_groups`` (and state, with ``inner_state``) heal too.
        """
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self._settings, self._needs, self.optimizer = settings, needs, optimizer

    # -- what the user's loop may call ---------------------------------------------------------------------------

    def add_samples(self, n: int) -> None:
        """Count ``n`` samples in the current step (default, when never called in a step: 1 per step); the
        average weighs each worker's tensor by the samples it contributed since the part's last round. In a
        synchronous job call it before the step's first forward, with all the step's samples (its micro-batches'
        too): the step's agreement starts at that forward."""
        if self.step_counted:
            raise ValueError(
                f"worker {self.worker!r}: add_samples({n}) after this step's first forward: a synchronous job counts "
                "a step's samples when its agreement starts, at that forward. Call ft.add_samples(n) once before the "
                "step's first forward, with every micro-batch's samples")
        self._step_samples = (self._step_samples or 0) + int(n)

    def accumulation(self, base: int) -> int:
        """The micro-batches to accumulate per step: ``base``, or with ``constant_batch`` ``base * workers /
        live`` (rounded up), so the global batch stays the same while workers are missing.

        Example:
            >>> for _ in range(ft.accumulation(4)): loss(next(batches)).backward()  # doctest: +SKIP
        """
        if not self.constant_batch or not self.members:
            return base
        return math.ceil(base * self.quorums.workers / len(self.members))

    def close(self) -> None:
        """End this worker's part in the job: its training is over. Stop the heartbeat and drop the group (the
        others stop waiting for this worker after ``stale_s``); a worker that joins after every other one closed
        is told at once that the job has ended (:class:`~bagua.torch_api.fault.quorum.JobEnded`)."""
        self._groups.drop()
        self.quorums.close(finished=True)

    # -- what the algorithm calls ----------------------------------------------------------------------------------

    def count_step(self, parts: int) -> None:
        """Count one step's samples towards each of the algorithm's ``parts``."""
        n = self._step_samples if self._step_samples is not None else 1
        for i in range(parts):
            self._samples[i] = self._samples.get(i, 0) + n
        self._step_samples = None

    def start_round(self, round: int, part: int) -> Round:
        """Agree on this round's members and heal whoever is behind; return this worker's :class:`Round`.

        ``round``: the rounds this worker's state has completed; ``part``: the part it synchronizes. A joining
        worker (before its first round, or after it found a round closed without it) takes part as a joiner
        instead: it heals from a source, and the returned round says so (``healed``). An error while healing is
        recorded (see :meth:`should_commit`); settings that differ raise :class:`SettingsDiffer`.
        """
        return self.enter_round(self.agree(round, part))

    def agree(self, round: int, part: int) -> Quorum:
        """Only the agreement of :meth:`start_round` (waits on the coordinator; no group, no heal, nothing of the
        model read or written), so it may run on a thread while the model computes; :meth:`enter_round` then
        starts the round on that quorum."""
        while True:
            try:
                quorum = self._lead_quorum(self._admitted if self._joining else lambda: self.quorums.wait(
                    self.quorums.next_key, Member(round, False, self._samples.get(part, 0), part, self._full_settings())))
                break
            except Excluded:
                if self._joining:
                    continue
                self.left_out += 1
                _log.warning("worker %r was left out of a round (it stalled past the deadline); joining again",
                             self.worker)
                self._joining = True
        return quorum

    def enter_round(self, quorum: Quorum) -> Round:
        """Start the round on ``quorum`` (from :meth:`agree`): check the settings, get the members' group, heal
        whoever is behind; return this worker's :class:`Round` (see :meth:`start_round`)."""
        differ = {m.id: m.settings for m in quorum.members if m.settings != self._full_settings()}
        if differ:
            raise SettingsDiffer(f"worker {self.worker!r} runs with {self._full_settings()}, but {differ}: every "
                                 f"worker of a job needs {self._needs}, and as many ranks; restart the workers "
                                 "with one setting")
        healed, sources, p = roles(quorum)
        rank = quorum.ids.index(self.worker)
        me_healed = self.worker in {m.id for m in healed}
        source_ids = {m.id for m in sources}
        claimed = [m.samples if m.id in source_ids else 0 for m in quorum.members]
        weights = tuple(bound_samples(claimed, self.max_sample_ratio))
        for m, c, w in zip(quorum.members, claimed, weights):
            if c != w:
                _log.warning("worker %r claims %d samples in quorum %d; it counts as %d (at most %g times the "
                             "median of the others')", m.id, c, quorum.key, w, self.max_sample_ratio)
        self._round = Round(quorum, rank, p, me_healed, weights)
        self._error = None
        self._started = time.monotonic()
        try:
            group = self._groups.get(quorum, rank, self._exchange_timeout(),
                                     self.ranks.rank if self.ranks is not None else None)
            for i, m in enumerate(healed):
                src = sources[(i + quorum.key) % len(sources)].id
                if src == self.worker:
                    serve_state(self._state_dict() if self._state_dict else {}, quorum.ids.index(m.id), group,
                                self.optimizer, self.inner_state, key=self._heal_key(quorum, src, m.id))
                    self.served += 1
                elif m.id == self.worker:
                    state, inner = heal_state(quorum.ids.index(src), group, key=self._heal_key(quorum, src, m.id))
                    if self._load_state_dict is not None:
                        self._load_state_dict(state)
                    load_inner_state(self.optimizer, inner)
                    self.heal_seconds.append(time.monotonic() - self._started)
        except ROUND_ERRORS as exc:
            self.fail(exc)
        return self._round

    def _heal_key(self, quorum: Quorum, src: str, dst: str) -> Optional[bytes]:
        """The key a healing transfer is signed with in a job with a secret: one per quorum, sender and receiver."""
        if self._secret is None:
            return None
        return derive(self._secret, f"heal/{self.quorums.prefix}/{quorum.key}/{src}/{dst}")

    def _admitted(self) -> Quorum:
        """Wait, as a joiner, to be admitted to a round after the last one closed."""
        key = max(self.quorums.latest() + 1, self.quorums.next_key)
        try:
            return self.quorums.wait(key, Member(-1, True, 0, -1, self._full_settings()))
        except Excluded:
            self.quorums.next_key = key + 1
            raise

    def fail(self, exc: BaseException) -> None:
        """Record that this worker's part of the round failed (its verdict will be ``retry``)."""
        if self._error is None:
            quorum = self._round.quorum.key if self._round is not None else -1
            _log.warning("worker %r: round of quorum %d failed (%s); the survivors run it again", self.worker,
                         quorum, exc)
            self._groups.drop()
        self._error = exc

    def should_commit(self) -> bool:
        """Report this worker's part of the round and return the round's verdict: ``True`` when every member holds
        its result (commit it), ``False`` when the survivors must run it again (restore what the round changed)."""
        r = self._round
        assert r is not None, "should_commit() without start_round()"
        ok = self._error is None
        if ok:
            self.exchange_seconds = (self.exchange_seconds + [time.monotonic() - self._started])[-16:]
        if not self._verdict(r.quorum, ok):
            self.retries += 1
            return False
        self.rounds += 1
        self.members = r.quorum.ids
        self._joining = False
        if r.healed:
            self.heals += 0 if r.quorum.first else 1  # the job's start copies the first worker: not a heal
            self._samples = {}
        elif r.part >= 0:
            self._samples[r.part] = 0
        return True

    def _full_settings(self) -> str:
        return f"{self._settings} ranks={self.ranks.size if self.ranks is not None else 1}"

    def _lead_quorum(self, fn: Callable[[], Quorum]) -> Quorum:
        """Wait for a quorum on the coordinator: here, or on the worker's first rank, shared (as JSON) with its
        other ranks."""
        if self.ranks is None:
            return fn()
        return Quorum.from_json(self.ranks.share(lambda: fn().to_json()))

    def _verdict(self, quorum: Quorum, ok: bool) -> bool:
        """Report this worker's exchange (ok on every one of its ranks) and return the round's verdict."""
        if self.ranks is None:
            return self.quorums.report(quorum, ok)
        ok = self.ranks.all_ok(ok)
        return self.ranks.share(lambda: self.quorums.report(quorum, ok))

    # -- timing ----------------------------------------------------------------------------------------------------

    def _exchange_timeout(self) -> float:
        if self.exchange_timeout_s is not None:
            return self.exchange_timeout_s
        return max(30.0, 4 * max(self.exchange_seconds)) if self.exchange_seconds else 30.0

    def median_exchange_s(self) -> float:
        """The median time of this worker's recent exchanges (0 before the first)."""
        return statistics.median(self.exchange_seconds) if self.exchange_seconds else 0.0
