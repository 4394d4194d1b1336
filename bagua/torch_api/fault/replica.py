"""Workers that fail alone: DiLoCo's synchronizations over the live workers, and healing from a peer.

:class:`FaultTolerance` is what :class:`~bagua.torch_api.contrib.diloco_optimizer.DiLoCoOptimizer` takes as
``fault_tolerance=``. Each worker is then a job of its own (one process, started by ``torchrun`` or any launcher,
which restarts it alone); the workers share no torch world. At each synchronization of a fragment:

1. the live workers agree on the round's members (:class:`~bagua.torch_api.fault.quorum.Quorums`): a worker that
   died or stalls past the deadline is left out;
2. they build a gloo group for exactly those members, or keep the last one when the members are the same;
3. a member that is joining (new, restarted, or left out of an earlier round) takes the job's state from a live
   peer (:func:`~bagua.torch_api.fault.heal.serve_driver`: checksummed, never unpickled) and contributes nothing
   to this round;
4. the pseudo-gradients are averaged, weighted by the samples each member contributed (a plain average, bit for
   bit today's, when they are equal; compressed, :mod:`~bagua.torch_api.fault.compressed`), and every member takes
   the same outer step;
5. a member whose exchange failed (a peer died mid-way) says so, and the survivors run the round again, from their
   pseudo-gradients as they were before it.

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

import datetime
import logging
import math
import socket
import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.fault.compressed import compressed_average, wire_bytes
from bagua.torch_api.fault.heal import TAKE_INNER_STATE, heal_driver, serve_driver
from bagua.torch_api.fault.quorum import Excluded, Quorums
from bagua.torch_api.fault.ranks import WorkerRanks

__all__ = ["FaultTolerance"]

_log = logging.getLogger(__name__)


def _route_to(address: str) -> str:
    """This machine's address on the route to ``host:port`` (what the gloo group binds to)."""
    host = address.rpartition(":")[0].strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet leaves: a datagram socket only picks its route
        return s.getsockname()[0]


class SettingsDiffer(ValueError):
    """The members of a round run DiLoCo with different settings: the job cannot go on (never retried)."""


def _settings(driver: Any, ranks: int) -> str:
    """What every worker of a job must share, as a string written to its slot: the exchange's shape, the outer
    step ("auto" resolved; each worker takes it on the same average, so different ones would part the weights) and
    the ranks (shards) per worker."""
    h = driver.hyper
    outer = ("custom" if h.outer_optimizer is not None else
             f"lr={h.outer_lr} momentum={h.outer_momentum} nesterov={h.nesterov} lr_warmup={h.outer_lr_warmup}")
    return (f"sync_every={h.sync_every} fragments={h.fragments} compression={h.compression} "
            f"block_size={h.block_size} ranks={ranks} outer: {outer}")


class FaultTolerance:
    """Run DiLoCo's synchronizations over whichever workers are alive (see the module docstring).

    Args:
        coordinator: ``"host:port"`` of the coordinator (``python -m bagua.torch_api.fault.coordinator``).
        worker: this worker's id, unique in the job and kept across its restarts (``"site-a"``).
        workers: the job's number of workers; the first synchronization waits for all of them.
        min_quorum: the fewest workers a round goes on with (``workers``: always wait for everyone).
        deadline_s: how long the arrived workers wait for a live one that has not; ``None`` adapts it to half
            the measured time between rounds (at least 2 s).
        constant_batch: :meth:`accumulation` scales the steps a worker accumulates by ``workers / live``, so the
            job's global batch stays the same while workers are missing.
        exchange_timeout_s: the most a round's exchange (heal and average) may take before it fails and the round
            is retried without the workers that did not answer; ``None``: 4x the slowest exchange measured, at
            least 30 s.
        heartbeat_s, stale_s: heartbeat period, and the silence after which a worker is not waited for.
        timeout_s: the most a wait for the coordinator or a quorum takes before it raises.
        inner_state: also take a peer's inner optimizer state when healing (measured: no better; see
            docs/fault_tolerance.md).
        hostname: the address the worker's gloo groups bind to (default: this machine's address on the route to
            the coordinator).
        prefix: the job's keys in the coordinator's store (several jobs may share one).

    Attributes: ``members`` (the last round's), ``rounds``, ``retries``, ``heals`` (times this worker healed),
    ``served`` (times it healed another), ``left_out`` (times it found a round closed without it),
    ``exchange_seconds``, ``heal_seconds``.
    """

    def __init__(self, coordinator: str, worker: str, workers: int, min_quorum: int = 1,
                 deadline_s: Optional[float] = None, constant_batch: bool = False,
                 exchange_timeout_s: Optional[float] = None, heartbeat_s: float = 0.5, stale_s: float = 3.0,
                 timeout_s: float = 300.0, inner_state: bool = TAKE_INNER_STATE, hostname: Optional[str] = None,
                 prefix: str = "bagua-ft") -> None:
        # user settings
        self.constant_batch = constant_batch
        self.exchange_timeout_s = exchange_timeout_s
        self.inner_state = inner_state
        self.quorums = Quorums(coordinator, worker, workers, min_quorum, deadline_s, heartbeat_s=heartbeat_s,
                               stale_s=stale_s, timeout_s=timeout_s, prefix=prefix)
        self.hostname = hostname or _route_to(coordinator)
        self.optimizer: Optional[torch.optim.Optimizer] = None  # the inner optimizer, set by DiLoCoOptimizer
        #: a worker of several ranks (a sharded model): its ranks, set by :meth:`bind_ranks`; None: one process
        self.ranks: Optional[WorkerRanks] = None
        # internal state
        self._group: Optional[Any] = None
        self._epoch: Optional[int] = None
        self._samples: dict[int, int] = {}  # fragment -> samples since its last synchronization
        self._step_samples: Optional[int] = None
        self._residuals: dict[int, torch.Tensor] = {}  # fragment -> error-feedback residual (compressed rounds)
        self._candidate: Optional[tuple[int, torch.Tensor]] = None  # the round's new residual, kept if it is ok
        # stats
        self.members: list[str] = []
        self.rounds = self.retries = self.heals = self.served = self.left_out = 0
        self.exchange_seconds: list[float] = []
        self.heal_seconds: list[float] = []

    @property
    def worker(self) -> str:
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

    def _settings(self, driver: Any) -> str:
        return _settings(driver, self.ranks.size if self.ranks is not None else 1)

    def _lead(self, fn: Callable[[], Any]) -> Any:
        """Run a call on the coordinator: here, or on the worker's first rank, shared with its other ranks."""
        return self.ranks.share(fn) if self.ranks is not None else fn()

    def _verdict(self, quorum: dict[str, Any], ok: bool) -> bool:
        """Report this worker's exchange (ok on every one of its ranks) and return the round's verdict."""
        if self.ranks is None:
            return self.quorums.report(quorum, ok)
        ok = self.ranks.all_ok(ok)
        return self.ranks.share(lambda: self.quorums.report(quorum, ok))

    # -- what the user's loop may call ---------------------------------------------------------------------------

    def add_samples(self, n: int) -> None:
        """Count ``n`` samples in the current inner step (default, when never called in a step: 1 per step); the
        average weighs each worker's pseudo-gradient by the samples it contributed since the fragment's last
        synchronization."""
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
        """Stop the heartbeat and drop the group (the others stop waiting for this worker after ``stale_s``)."""
        self._drop_group()
        self.quorums.close()

    # -- what the driver calls -------------------------------------------------------------------------------------

    def on_step(self, fragments: int) -> None:
        """Count one inner step's samples towards every fragment."""
        n = self._step_samples if self._step_samples is not None else 1
        for i in range(fragments):
            self._samples[i] = self._samples.get(i, 0) + n
        self._step_samples = None

    def exchange(self, driver: Any, fragment: Any) -> bool:
        """Average ``fragment.delta`` over this round's quorum, in place; retry without workers that fail.

        Returns False when this worker was left out of the round: it then joined a later one and holds the peer's
        state (weights, counters) with that round's outer step taken, so the caller skips its own.
        """
        saved = fragment.delta.clone()
        while True:
            me = {"round": driver.syncs, "joining": False, "samples": self._samples.get(fragment.index, 0),
                  "fragment": fragment.index, "settings": self._settings(driver)}
            try:
                quorum = self._lead(lambda: self.quorums.wait(self.quorums.next_key, me))
            except Excluded:
                self.left_out += 1
                _log.warning("worker %r was left out of a round (it stalled past the deadline); joining again",
                             self.worker)
                self.join(driver)
                return False
            healed = self._run(driver, quorum, fragment)
            if self._verdict(quorum, healed is not None):
                return self._done(driver, quorum, bool(healed))
            self.retries += 1
            fragment.delta.copy_(saved)

    @torch.no_grad()
    def join(self, driver: Any) -> None:
        """Wait to be admitted to a round, take the job's state from a live peer and that round's outer step (or,
        in the job's first round, everyone takes the first worker's weights)."""
        me = {"round": -1, "joining": True, "samples": 0, "fragment": -1, "settings": self._settings(driver)}

        def admitted() -> dict[str, Any]:
            key = max(self.quorums.latest() + 1, self.quorums.next_key)
            try:
                return self.quorums.wait(key, me)
            except Excluded:
                self.quorums.next_key = key + 1
                raise

        while True:
            try:
                quorum = self._lead(admitted)
            except Excluded:
                continue
            ok = self._run(driver, quorum, None) is not None
            if self._verdict(quorum, ok):
                self._done(driver, quorum, True)
                return
            self.retries += 1

    # -- one round -------------------------------------------------------------------------------------------------

    @staticmethod
    def _roles(quorum: dict[str, Any]) -> tuple[list[dict], list[dict], int]:
        """The members who heal, those who serve, and the fragment the round synchronizes (-1: none)."""
        members = quorum["members"]
        if quorum["first"]:
            return members[1:], members[:1], -1
        current = [m for m in members if not m["joining"]]
        top = max(m["round"] for m in current)
        sources = [m for m in current if m["round"] == top]
        healed = [m for m in members if m not in sources]
        return healed, sources, sources[0]["fragment"]

    def _run(self, driver: Any, quorum: dict[str, Any], fragment: Any) -> Optional[bool]:
        """Heal and average within ``quorum``; return whether this worker healed, or None when the round failed."""
        ids = [m["id"] for m in quorum["members"]]
        rank = ids.index(self.worker)
        self._candidate = None
        mine = self._settings(driver)
        differ = {m["id"]: m.get("settings") for m in quorum["members"] if m.get("settings") != mine}
        if differ:
            raise SettingsDiffer(f"worker {self.worker!r} runs DiLoCo with {mine}, but {differ}: every worker of a "
                                 "job needs the same sync_every, fragments, compression and outer step, and as "
                                 "many ranks; restart the workers with one setting")
        healed, sources, p = self._roles(quorum)
        me_healed = self.worker in {m["id"] for m in healed}
        start = time.monotonic()
        try:
            group = self._group_for(quorum, rank, len(ids))
            for i, m in enumerate(healed):
                src = sources[(i + quorum["key"]) % len(sources)]["id"]
                if src == self.worker:
                    serve_driver(driver, ids.index(m["id"]), group, self.optimizer, self.inner_state)
                    self.served += 1
                elif m["id"] == self.worker:
                    heal_driver(driver, ids.index(src), group, self.optimizer)
                    self.heal_seconds.append(time.monotonic() - start)
            if p >= 0:
                if not me_healed and fragment.index != p:
                    raise ValueError(f"worker {self.worker!r} synchronizes fragment {fragment.index} while the "
                                     f"others synchronize {p}: the workers' DiLoCo settings differ")
                self._average(driver, driver.fragments[p], quorum, rank, group, me_healed, sources)
        except (RuntimeError, ValueError, TimeoutError, OSError) as exc:
            _log.warning("worker %r: round of quorum %d failed (%s); the survivors run it again", self.worker,
                         quorum["key"], exc)
            self._drop_group()
            return None
        self.exchange_seconds = (self.exchange_seconds + [time.monotonic() - start])[-16:]
        return me_healed

    def _average(self, driver: Any, fragment: Any, quorum: dict[str, Any], rank: int, group: Any, healed: bool,
                 sources: list[dict]) -> None:
        """Average the fragment's pseudo-gradient over the members, weighted by samples; healed members add 0."""
        source_ids = {m["id"] for m in sources}
        weights = [m["samples"] if m["id"] in source_ids else 0 for m in quorum["members"]]
        delta = fragment.delta
        n = len(weights)
        codec = driver.hyper.compression
        if codec != "none":
            residual = None
            if driver.error_feedback and not healed:
                residual = self._residuals.get(fragment.index)
                residual = torch.zeros_like(delta) if residual is None else residual
            new = compressed_average(group, delta, weights, rank, codec, driver.hyper.block_size, residual,
                                     self._exchange_timeout())
            if new is not None:
                self._candidate = (fragment.index, new)
            driver.bytes_sent += wire_bytes(delta.numel(), codec, driver.hyper.block_size, n)
            return
        buf = delta if delta.device.type == "cpu" else delta.cpu()
        timeout = datetime.timedelta(seconds=self._exchange_timeout())
        if healed:
            buf.zero_()
        if all(w == weights[0] for w in weights):  # a plain average, bit for bit DiLoCo's without faults
            group.allreduce([buf]).wait(timeout)
            buf.div_(len(weights))
        else:
            buf.mul_(weights[rank] / max(1, sum(weights)))
            group.allreduce([buf]).wait(timeout)
        if buf is not delta:
            delta.copy_(buf)
        driver.bytes_sent += 2 * (n - 1) * 4 * delta.numel() // n

    def _done(self, driver: Any, quorum: dict[str, Any], healed: bool) -> bool:
        """After an ``ok`` verdict: a healed worker takes the round's outer step itself (returns False)."""
        self.rounds += 1
        self.members = [m["id"] for m in quorum["members"]]
        _, _, p = self._roles(quorum)
        if not healed:
            self._samples[p] = 0
            if self._candidate is not None:  # the round is ok: its residual is this worker's now
                self._residuals[self._candidate[0]] = self._candidate[1]
            return True
        self.heals += int(not quorum["first"] or self.members[0] != self.worker)
        self._samples = {}
        self._residuals = {}  # per-worker state starts empty after a heal
        if p >= 0:
            driver.finish_now(driver.fragments[p])
        return False

    # -- the round's group -----------------------------------------------------------------------------------------

    def _exchange_timeout(self) -> float:
        if self.exchange_timeout_s is not None:
            return self.exchange_timeout_s
        return max(30.0, 4 * max(self.exchange_seconds)) if self.exchange_seconds else 30.0

    def _group_for(self, quorum: dict[str, Any], rank: int, size: int) -> Any:
        """The gloo group of exactly the quorum's members: the last one when the members are the same."""
        if self._group is not None and self._epoch == quorum["epoch"]:
            return self._group
        self._drop_group()
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=self._exchange_timeout())
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.hostname)]
        shard = f"s{self.ranks.rank}/" if self.ranks is not None else ""  # a group per shard: its ranks of each member
        store = dist.PrefixStore(f"{self.quorums.prefix}/pg/{quorum['epoch']}/{shard}", self.quorums.store)
        self._group = dist.ProcessGroupGloo(store, rank, size, opts)
        self._epoch = quorum["epoch"]
        return self._group

    def _drop_group(self) -> None:
        if self._group is not None:
            try:
                self._group.abort()
            except RuntimeError:
                pass
        self._group = self._epoch = None

    def median_exchange_s(self) -> float:
        """The median time of this worker's recent exchanges (0 before the first)."""
        return statistics.median(self.exchange_seconds) if self.exchange_seconds else 0.0
