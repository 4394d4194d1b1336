"""Asynchronous DiLoCo under fault tolerance: every worker applies every arrival, in the order the store gave them.

``DiLoCoAlgorithm(asynchronous=True, fault_tolerance=ft)`` / ``DiLoCoOptimizer(..., asynchronous=True,
fault_tolerance=ft)``: each worker is a job of its own (no torch world in common, so no server thread on a rank 0).
The coordinator's store orders the arrivals instead (:mod:`~bagua.torch_api.ops.diloco_async_log`):

1. a worker that finishes its round writes its pseudo-gradient (float32, or a block codec's bytes with error
   feedback, :class:`~bagua.torch_api.ops.diloco_async_wire.AsyncWire`) and takes the next *sequence number*;
2. every worker holds the global weights and the outer state (:class:`~bagua.torch_api.ops.diloco_async_outer.
   AsyncOuter`: token-weighted, delayed Nesterov, the rule of the server of the plain asynchronous mode) and applies
   ALL arrivals in sequence order, its own when its turn comes, so every worker holds the same global weights, bit
   for bit, at the same sequence number; it then continues from the newest global weights it applied (its own
   arrival and whatever arrived before it, plus the later ones already in the store). A worker waits only for a
   slot whose number was taken and not yet written (a few store calls; a writer that died there is voided after
   ``stale_s``), never for a peer's round;
3. arrivals that every live worker applied are deleted from the store (it holds the arrivals in flight only);
4. a worker takes the job's start (the first worker's weights) and applies the log from its first slot while
   nothing was deleted; later (it started late, or was killed and restarted, or stalled while the others deleted
   what it had not applied) it *heals*: it asks through the store, and the first live peer to reach the end of a round
   stores its state (global weights, outer momentum, sequence number) for it; the worker's own rounds so far come
   from its own record, so its step counter resumes where its last finished round left it;
5. :meth:`AsyncFaultTolerant.finish` (``close()``) says this worker is done, waits until every other worker is done
   or dead (serving heals meanwhile), then the last slot is fixed once for the job and every worker applies
   everything up to it: all end with the same weights, bit for bit.

Each arrival's record is sealed with the job secret when there is one; a record that fails (written without the
secret, changed, moved), or holds bytes of the wrong size, NaN/Inf, or a base version that does not exist yet, is
skipped by every worker alike, with a warning. Every wait is bounded by the ``FaultTolerance``'s ``timeout_s``.

Cost: each arrival crosses the coordinator once up and once down per worker (``workers`` times the model's bytes
per round, through one ``TCPStore``): meant for models whose pseudo-gradient is tens of MB or less (use a codec).

Example:
    >>> ft = FaultTolerance("10.0.0.1:29600", worker="site-a", workers=3)  # doctest: +SKIP
    >>> opt = DiLoCoOptimizer(inner, sync_every=20, asynchronous=True, fault_tolerance=ft)  # doctest: +SKIP
    >>> ...; opt.close(); ft.close()  # every worker ends with the same global weights  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple, Optional

import torch

from bagua.torch_api.fault.quorum import JobEnded
from bagua.torch_api.fault.replica import SettingsDiffer
from bagua.torch_api.ops.diloco_async_log import ArrivalLog, Slot, pack_state, unpack_state
from bagua.torch_api.ops.diloco_async_outer import DEFAULT_REMEDY, Arrival, AsyncOuter
from bagua.torch_api.ops.diloco_async_wire import AsyncWire, pseudo_gradient

__all__ = ["AsyncFaultTolerant", "Applied"]

logger = logging.getLogger(__name__)

_HEAL_TRIES = 8


class Applied(NamedTuple):
    """One slot of the log applied here: its sequence number, the worker that sent it and what was logged."""

    seq: int
    worker: str
    arrival: Arrival


class AsyncFaultTolerant:
    """One worker's side of asynchronous DiLoCo under fault tolerance (see the module docstring): the same
    interface as :class:`~bagua.torch_api.ops.diloco_async.AsyncDiLoCo` (``start``, ``exchange``, ``finish``).

    Args:
        hyper: the settings, outer ones resolved for the job's ``workers``.
        fault: this worker's :class:`~bagua.torch_api.fault.replica.FaultTolerance` (its store, secret, ids and
            heartbeats; no quorum rounds are run).
        owner: names the caller in errors.

    Attributes: ``version`` (the global version this worker's round started from), ``cursor`` (the slots of the
    log applied here), ``exchanges`` (this worker's rounds, across its restarts), ``arrivals`` (an
    :class:`Applied` per arrival applied by this process, in order), ``posted`` (the sequence numbers this process
    took), ``heals``, ``served``, ``ignored`` (junk slots skipped), ``exchange_s``.

    Example:
        >>> run = AsyncFaultTolerant(settings, ft, owner="DiLoCoOptimizer")  # doctest: +SKIP
        >>> run.start(fragment); run.exchange(fragment, tokens=20); run.finish(fragment)  # doctest: +SKIP
    """

    def __init__(self, hyper: Any, fault: Any, owner: str) -> None:
        q = fault.quorums
        # user settings
        self.hyper = hyper
        self.fault = fault
        self.owner = owner
        self.timeout_s = q.timeout_s
        # internal state
        self.log = ArrivalLog(q.store, q.records, q.prefix, q.worker, q.incarnation, hole_s=q.stale_s)
        self.worker = q.worker
        self.version = 0
        self.cursor = 0
        self.exchanges = 0
        self.finished = False
        self.outer: Optional[AsyncOuter] = None
        self.wire: Optional[AsyncWire] = None
        self._mine: dict[int, tuple[torch.Tensor, Slot]] = {}  # this process's arrivals not applied yet
        self._keys: dict[int, str] = {}  # data keys of the arrivals applied and not deleted yet
        self._deleted = 0
        self._requests = -1  # the heal-request counter last seen
        self._served: set[str] = set()
        self._attempt = 0
        # stats
        self.arrivals: list[Applied] = []
        self.posted: list[int] = []
        self.heals = self.served = self.ignored = 0
        self.exchange_s = 0.0

    @property
    def resume_steps(self) -> int:
        """The inner steps this worker's finished rounds took (its steps after a restart)."""
        return self.exchanges * self.hyper.sync_every

    def check_checkpoint(self) -> None:
        """Refuse a checkpoint of a run in progress, saying why (a restarted worker heals from a peer instead)."""
        if not self.finished:
            raise ValueError(f"{self.owner}(asynchronous=True, fault_tolerance=...) does not checkpoint a run in "
                             "progress: a restarted worker heals from a live peer. Save after close()")

    def settings_text(self) -> str:
        """What every worker must share: the exchange and the outer step."""
        h = self.hyper
        return (f"asynchronous sync_every={h.sync_every} compression={h.compression} block_size={h.block_size} "
                f"lr={h.outer_lr} momentum={h.outer_momentum} nesterov={h.nesterov} lr_warmup={h.outer_lr_warmup} "
                f"workers={self.fault.workers} numel={self.wire.numel if self.wire else 0}")

    # -- start ---------------------------------------------------------------------------------------------------

    def start(self, fragment: Any) -> None:
        """Join the job over ``fragment`` (one :class:`~bagua.torch_api.ops.diloco.Fragment` holding every
        parameter): the first worker's weights at the start, a live peer's state later."""
        if self.wire is not None:
            return
        h = self.hyper
        error_feedback = h.compression != "none" if h.error_feedback is None else h.error_feedback
        self.wire = AsyncWire(h.compression, fragment.numel, h.block_size, error_feedback)
        self.outer = AsyncOuter(fragment.global_.detach().to("cpu", torch.float32, copy=True), self.fault.workers,
                                h.outer_lr, h.outer_momentum, h.nesterov, h.outer_lr_warmup, DEFAULT_REMEDY)
        self._raise_if_ended("join")
        self.log.set_done(False)  # a restarted worker takes part again
        mine = self.log.progress([self.worker]).get(self.worker)
        self.exchanges = int(mine.get("exchanges", 0)) if mine else 0
        self._deleted = self.log.deleted()
        if self._deleted == 0 and self._take_start(fragment):  # the start, then every arrival from slot 1
            return
        self._heal(fragment)

    def _take_start(self, fragment: Any) -> bool:
        """Store this worker's state as the job's start, or take the one stored; False when none is usable."""
        full = self.log.full("start")
        ours = pack_state(self.log.records, full, self._meta(), self._tensors())
        raw = self.log.claim_state("start", ours)
        for _ in range(4):
            if raw == ours:
                self.log.publish(self.cursor, self.exchanges)
                return True
            got = unpack_state(self.log.records, full, raw)
            if got is not None:
                self._load(fragment, *got)
                return True
            raw = self.log.store.compare_set(full, raw, ours)  # junk: replace it
        return False

    # -- a worker's round ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def exchange(self, fragment: Any, tokens: int) -> None:
        """Post this worker's pseudo-gradient and the ``tokens`` behind it, apply the log through it, and continue
        from the newest global weights applied."""
        if self.finished:
            raise ValueError(f"{self.owner}(asynchronous=True): an inner step after close(); build a new one")
        assert self.wire is not None and self.outer is not None, "start() was not called"
        started = time.monotonic()
        delta = pseudo_gradient(fragment, self.owner, f"worker {self.worker!r}")
        wire = self.wire.encode_up(delta.clone())
        data = wire.contiguous().numpy().tobytes()
        seq, key = self.log.post(data, int(tokens), self.version)
        self.posted.append(seq)
        self._mine[seq] = (self.wire.decode(wire).clone(), Slot("arrival", self.worker, int(tokens), self.version,
                                                                 key=key))
        final = self.log.final()
        if final is not None and seq > final:
            self._raise_if_ended("post")
        self._apply(fragment, seq, wait=True)
        self._apply(fragment, self.log.taken() if final is None else final, wait=False)  # the newest there
        self.exchanges += 1
        self._adopt(fragment)
        self.log.publish(self.cursor, self.exchanges)
        self._serve_heals()
        self._collect()
        self.exchange_s += time.monotonic() - started

    def finish(self, fragment: Any) -> None:
        """Say this worker is done, wait until every other worker is done or dead (serving heals), then apply the
        log through the job's last slot: every worker ends with the same global weights. Idempotent."""
        if self.finished or self.outer is None:
            return
        self.finished = True
        self.log.set_done(True)
        deadline = time.monotonic() + self.timeout_s
        final = self.log.final()
        while final is None:
            self._serve_heals()
            others = [w for w in self.fault.quorums.registered() if w != self.worker]
            done, live = self.log.done(others), self.fault.quorums.live()
            if all(w in done or w not in live for w in others):
                final = self.log.claim_final()
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.owner}(asynchronous=True): worker {self.worker!r} closed and waited {self.timeout_s:g} s "
                    f"(FaultTolerance timeout_s) for {sorted(w for w in others if w in live and w not in done)}, "
                    "live and not closed: every worker calls close() when it ends; raise timeout_s when a worker "
                    "trains longer than that after the first one closed")
            time.sleep(0.05)
            final = self.log.final()
        if self.cursor > final:
            raise JobEnded(f"worker {self.worker!r} applied slot {self.cursor} of the asynchronous log, past the job's "
                           f"last one ({final}): it stalled past stale_s while every other worker closed")
        self._apply(fragment, final, wait=True)
        self._adopt(fragment)
        self.log.publish(self.cursor, self.exchanges)
        self._collect()
        logger.info("%s(asynchronous=True): worker %r ends at global version %d (slot %d of the log)", self.owner,
                    self.worker, self.version, self.cursor)

    # -- the log -------------------------------------------------------------------------------------------------

    def _apply(self, fragment: Any, through: int, wait: bool) -> None:
        """Apply the slots after :attr:`cursor` through ``through``; without ``wait``, stop at an empty one."""
        while self.cursor < through:
            seq = self.cursor + 1
            if seq in self._mine:
                delta, slot = self._mine.pop(seq)
            else:
                found = self.log.slot(seq, wait)
                if found is None:
                    return
                if found.kind == "gone":  # deleted: the others applied it while this worker stalled
                    logger.warning("%s(asynchronous=True): worker %r is behind (slot %d of the log was deleted); it "
                                   "heals from a live peer", self.owner, self.worker, seq)
                    self._heal(fragment)
                    continue
                slot, delta = found, self._decode(seq, found)
            if delta is not None:
                self._apply_one(seq, slot, delta)
            self.cursor = seq

    def _decode(self, seq: int, slot: Slot) -> Optional[torch.Tensor]:
        """The pseudo-gradient of an arrival, or ``None`` for a void slot or junk (counted and warned about)."""
        assert self.wire is not None and self.outer is not None
        if slot.kind != "arrival":  # void, or junk (counted and warned about when read)
            self.ignored += slot.kind == "junk"
            return None
        why = ""
        empty = self.wire.empty()
        if len(slot.data) != empty.numel() * empty.element_size():
            why = f"{len(slot.data)} bytes, not the model's {empty.numel() * empty.element_size()}"
        elif not (slot.tokens >= 1 and 0 <= slot.base <= self.outer.version):
            why = f"tokens {slot.tokens}, base version {slot.base} (now {self.outer.version})"
        delta = None
        if not why:
            delta = self.wire.decode(torch.frombuffer(bytearray(slot.data), dtype=empty.dtype))
            why = "" if bool(torch.isfinite(delta).all()) else "NaN or Inf"
        if why:
            self.ignored += 1
            self.log.refuse(seq, f"an asynchronous arrival skipped by every worker: {why}")
            return None
        return delta

    def _apply_one(self, seq: int, slot: Slot, delta: torch.Tensor) -> None:
        assert self.outer is not None
        arrival = self.outer.apply(0, slot.tokens, slot.base, delta)
        self._keys[seq] = slot.key
        self.arrivals.append(Applied(seq, slot.worker, arrival))
        logger.debug("asynchronous DiLoCo: slot %d from worker %r made version %d (%d tokens, staleness %d, weight "
                     "%.3f)", seq, slot.worker, arrival.version, arrival.tokens, arrival.staleness, arrival.weight)

    @torch.no_grad()
    def _adopt(self, fragment: Any) -> None:
        assert self.outer is not None
        fragment.global_.copy_(self.outer.global_)
        offset = 0
        for p in fragment.params:
            p.copy_(fragment.global_[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.version = self.outer.version

    def _collect(self) -> None:
        """Delete the slots every live worker applied."""
        others = sorted(self.fault.quorums.live() - {self.worker})
        progress = self.log.progress(others)
        upto = min([self.cursor] + [progress[w]["cursor"] if w in progress else 0 for w in others])
        if upto > self._deleted:
            keys = [self._keys.pop(s) for s in sorted(self._keys) if s <= upto]
            self.log.delete(upto, [k for k in keys if k], self._deleted + 1)
            self._deleted = upto

    # -- heals ---------------------------------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        assert self.outer is not None
        return {"version": self.outer.version, "tokens_total": self.outer.tokens_total, "cursor": self.cursor,
                "settings": self.settings_text()}

    def _tensors(self) -> list[torch.Tensor]:
        assert self.outer is not None
        extra = [self.outer.buf, self.outer.acc] if self.outer.buf is not None and self.outer.acc is not None else []
        return [self.outer.global_, *extra]

    def _load(self, fragment: Any, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """Take a peer's state (or the job's start)."""
        assert self.outer is not None
        if meta.get("settings") != self.settings_text():
            raise SettingsDiffer(f"worker {self.worker!r} runs with {self.settings_text()}, but a peer with "
                                 f"{meta.get('settings')}: every worker of a job needs the same sync_every, "
                                 "compression, outer step and model; restart the workers with one setting")
        for mine, theirs in zip(self._tensors(), tensors):
            mine.copy_(theirs)
        self.outer.version, self.outer.tokens_total = int(meta["version"]), int(meta["tokens_total"])
        self.cursor = int(meta["cursor"])
        self._mine = {s: m for s, m in self._mine.items() if s > self.cursor}
        self._adopt(fragment)
        self.log.publish(self.cursor, self.exchanges)

    def _heal(self, fragment: Any) -> None:
        """Ask a live peer for its state through the store and take it (bounded by ``timeout_s``)."""
        started = time.monotonic()
        deadline = started + self.timeout_s
        for _ in range(_HEAL_TRIES):
            self._attempt += 1
            nonce = f"{self.worker}.{self.log.incarnation}.{self._attempt}"
            self.log.request_heal(nonce)
            asked, checked = time.monotonic(), time.monotonic()
            while True:
                raw = self.log.state(f"heal/state/{nonce}")
                if raw is not None:
                    got = unpack_state(self.log.records, self.log.full(f"heal/state/{nonce}"), raw)
                    self.log.drop_heal(nonce)
                    if got is None:
                        break  # junk: ask again
                    self._load(fragment, *got)
                    self.heals += 1
                    logger.info("%s(asynchronous=True): worker %r healed from %s in %.2f s, at slot %d of the log",
                                self.owner, self.worker, got[0].get("by", "a peer"), time.monotonic() - started,
                                self.cursor)
                    return
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(
                        f"{self.owner}(asynchronous=True): worker {self.worker!r} asked for a live peer's state "
                        f"and none came within {self.timeout_s:g} s (FaultTolerance timeout_s): no other worker "
                        "is alive and training; start one, or start the job anew")
                if now - checked > 0.5:
                    checked = now
                    self._raise_if_ended("heal")
                    server = self.log.server_of(nonce)
                    if server is not None and server not in self.fault.quorums.live() and \
                            now - asked > self.fault.quorums.stale_s:
                        break  # its server died: ask again
                time.sleep(0.01)
        raise RuntimeError(f"{self.owner}(asynchronous=True): worker {self.worker!r} asked {_HEAL_TRIES} times for "
                           "a peer's state and got none that passed its checks (see the warnings)")

    def _serve_heals(self) -> None:
        """Store this worker's state for each worker that asked and that no other peer serves."""
        made = self.log.requests_made()
        if made == self._requests:
            return
        self._requests = made
        others = [w for w in self.fault.quorums.registered() if w != self.worker]
        for w, nonce in self.log.heal_requests(others).items():
            if nonce in self._served or self.log.claim_heal(nonce) != self.worker:
                continue
            full = self.log.full(f"heal/state/{nonce}")
            self.log.store.set(full, pack_state(self.log.records, full, dict(self._meta(), by=self.worker),
                                                self._tensors()))
            self._served.add(nonce)
            self.served += 1
            logger.info("%s(asynchronous=True): worker %r sent its state (slot %d of the log) to %r", self.owner,
                        self.worker, self.cursor, w)

    def _raise_if_ended(self, when: str) -> None:
        final = self.log.final()
        if final is not None:
            raise JobEnded(f"worker {self.worker!r} ({when}): the asynchronous job has ended: every other worker "
                           f"closed, and the last slot of its log is {final}. To train further, start a new job "
                           "(another coordinator or prefix=)")
