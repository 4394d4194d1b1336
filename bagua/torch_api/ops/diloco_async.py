"""Asynchronous DiLoCo's exchanges: a worker's pseudo-gradient is applied when it arrives, nobody waits.

``DiLoCoAlgorithm(asynchronous=True)`` / ``contrib.DiLoCoOptimizer(..., asynchronous=True)``: every worker (rank)
runs its rounds of ``sync_every`` inner steps at its own pace. When a round ends, the worker sends its
pseudo-gradient ``delta = g_b - x`` (``g_b``: the global weights of version ``b`` it started from) to the
*server* on the first rank of the group, which applies it at once with the outer step of
:class:`~bagua.torch_api.ops.diloco_async_outer.AsyncOuter` (token-weighted, delayed Nesterov; its docstring gives
the rule and the measurement that chose it) and answers with the newest global weights, from which the worker
continues (``x = g``). A slow worker therefore delays nobody; its pseudo-gradient lands on weights that moved on
(its *staleness*, logged).

Transport: torch.distributed only. The server is a thread on the first rank with a gloo group of its own (created
by every rank when the algorithm or optimizer is built, so nothing it sends meets another collective). A worker
sends a small float64 header ``(kind, worker, tokens, base version)`` and its pseudo-gradient by point-to-point
``send``; the server receives headers from any source, so arrivals are served in the order they come, one at a
time, and sends back ``(version,)`` and the global weights. Both travel in float32, or with ``compression`` through
a block codec of the registry, both ways, losing nothing over time (:mod:`~bagua.torch_api.ops.diloco_async_wire`).
The first rank's own worker calls the server in-process, under the same lock. Nothing received is unpickled: only
tensors of known shape travel.

The end: :meth:`AsyncDiLoCo.finish` (``DiLoCoOptimizer.close()``, or ``model.bagua_ddp.close()`` under
``with_bagua``; call it on every rank when training ends) sends ``done`` and waits until every worker has; the
server then sends everyone the final global weights, so all ranks end with the same weights, bit for bit. The
inner steps of an unfinished round are dropped. Every wait is bounded by ``BAGUA_COMM_TIMEOUT_S``: a dead peer (or a
worker that never calls ``close()``) gives an error naming the rank, never a hang, so set it above the longest time
a worker may train on after the first one finished. The server's :attr:`AsyncDiLoCo.arrivals` (on the first rank) is
the ordered log of every arrival applied.

Example:
    >>> inner = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
    >>> optimizer = DiLoCoOptimizer(inner, sync_every=20, asynchronous=True)  # doctest: +SKIP
    >>> for batch in data: loss(model, batch).backward(); optimizer.step(); optimizer.zero_grad()  # doctest: +SKIP
    >>> optimizer.close()  # every rank: all end with the same global weights  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from bagua.torch_api import env
from bagua.torch_api.ops.diloco_async_outer import DEFAULT_REMEDY, Arrival, AsyncOuter
from bagua.torch_api.ops.diloco_async_wire import AsyncWire, pseudo_gradient

__all__ = ["AsyncDiLoCo", "ARRIVAL", "DONE"]

logger = logging.getLogger(__name__)

#: the kinds of a worker's header
ARRIVAL, DONE = 1.0, 2.0
_TAG_HEADER, _TAG_DELTA, _TAG_VERSION, _TAG_GLOBAL, _TAG_FINAL = 11, 12, 13, 14, 15


class AsyncDiLoCo:
    """One rank's side of asynchronous DiLoCo: its worker's exchanges, and on the first rank the server.

    Building it is collective (a gloo group over ``ranks``; every process of the torch world builds it, in the same
    order relative to other groups). ``ranks`` must be the whole world: one model per rank.

    Args:
        hyper: the settings, outer ones resolved (``outer_lr``, ``outer_momentum``, ``nesterov``,
            ``outer_lr_warmup``), and the exchange's ``compression``, ``block_size`` and ``error_feedback``
            (:class:`~bagua.torch_api.ops.diloco_async_wire.AsyncWire`).
        ranks: the global ranks of the workers; the first is the server.
        owner: names the caller in errors.

    Attributes: ``version`` (the global version this worker's weights are), ``exchanges`` and ``exchange_s`` (this
    worker's exchanges and the seconds it spent in them, not training), ``arrivals`` (the server's log of
    :class:`~bagua.torch_api.ops.diloco_async_outer.Arrival`, on the first rank; empty elsewhere), ``global_``
    (the server's newest global weights, a copy, on the first rank; ``None`` elsewhere).

    Example:
        >>> run = AsyncDiLoCo(settings, ranks=[0, 1], owner="DiLoCo")  # doctest: +SKIP
        >>> run.start(fragment); run.exchange(fragment, tokens=20); run.finish(fragment)  # doctest: +SKIP
    """

    def __init__(self, hyper: Any, ranks: list[int], owner: str) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"{owner}(asynchronous=True) needs torch.distributed: call init_process_group() first")
        ranks = sorted(ranks)
        if len(ranks) != dist.get_world_size():
            raise ValueError(f"{owner}(asynchronous=True) runs over the whole torch world, one model per rank; this "
                             f"group holds {len(ranks)} of its {dist.get_world_size()} ranks (a sub-group, or FSDP2 "
                             "shards). Use the default group, or asynchronous=False")
        # user settings
        self.hyper = hyper
        self.owner = owner
        self.ranks = ranks
        self.timeout_s = env.get_comm_timeout_s()
        # internal state
        self.index = ranks.index(dist.get_rank())
        self.group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        self.version = 0
        self.finished = False
        self.exchanges = 0
        self.exchange_s = 0.0
        self.outer: Optional[AsyncOuter] = None  # the server's (first rank)
        self.wire: Optional[AsyncWire] = None
        self._held: Optional[torch.Tensor] = None  # this worker's copy of the global weights (CPU float32)
        self._mirrors: dict[int, torch.Tensor] = {}  # the server's copy of each worker's (with a codec)
        self._lock = threading.Lock()
        self._local_done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    @property
    def is_server(self) -> bool:
        """Whether this rank holds the global weights and serves the others."""
        return self.index == 0

    @property
    def arrivals(self) -> list[Arrival]:
        """The server's ordered log of arrivals (a copy); empty on other ranks."""
        if self.outer is None:
            return []
        with self._lock:
            return list(self.outer.log)

    def check_checkpoint(self) -> None:
        """Refuse a checkpoint of a run in progress, saying why (after :meth:`finish` it holds the final weights)."""
        if not self.finished:
            raise ValueError(
                f"{self.owner}(asynchronous=True) does not checkpoint a run in progress (yet): each worker's round "
                "started from its own global version and the server's state lives on the first rank only. Save after "
                "close() on every rank (all then hold the final global weights), or train with asynchronous=False")

    @property
    def global_(self) -> Optional[torch.Tensor]:
        """The server's newest global weights (flat float32, a copy) on the first rank; ``None`` elsewhere."""
        if self.outer is None:
            return None
        with self._lock:
            return self.outer.global_.clone()

    # -- start -------------------------------------------------------------------------------------------------

    def start(self, fragment: Any) -> None:
        """Begin over ``fragment`` (one :class:`~bagua.torch_api.ops.diloco.Fragment` holding every parameter),
        whose global weights are the same on every rank: on the first rank, the server starts from them."""
        if self.wire is not None:
            return
        h = self.hyper
        error_feedback = h.compression != "none" if h.error_feedback is None else h.error_feedback
        self.wire = AsyncWire(h.compression, fragment.numel, h.block_size, error_feedback)
        self._held = fragment.global_.detach().to("cpu", torch.float32, copy=True)
        if not self.is_server:
            return
        self.outer = AsyncOuter(self._held.clone(), len(self.ranks), h.outer_lr, h.outer_momentum, h.nesterov,
                                h.outer_lr_warmup, DEFAULT_REMEDY)
        if self.wire.compressed:
            self._mirrors = {w: self._held.clone() for w in range(1, len(self.ranks))}
        if len(self.ranks) > 1:
            self._thread = threading.Thread(target=self._serve, args=(fragment.numel,), daemon=True,
                                            name="bagua-diloco-async-server")
            self._thread.start()

    # -- a worker's round --------------------------------------------------------------------------------------

    @torch.no_grad()
    def exchange(self, fragment: Any, tokens: int) -> None:
        """Send this worker's pseudo-gradient and the ``tokens`` behind it (its samples since its last exchange:
        1 per inner step unless the driver's ``add_samples(n)`` counted them), and continue from the newest global
        weights."""
        if self.finished:
            raise ValueError(f"{self.owner}(asynchronous=True): an inner step after close(); build a new one")
        started = time.monotonic()
        delta = pseudo_gradient(fragment, self.owner, f"rank {dist.get_rank()}")
        if self.is_server:
            self._raise_server_error()
            assert self.outer is not None, "start() was not called"
            with self._lock:
                arrival = self.outer.apply(0, int(tokens), self.version, delta)
                version, new = self.outer.version, self.outer.global_.clone()
            self._log(arrival)
        else:
            assert self.wire is not None and self._held is not None, "start() was not called"
            header = torch.tensor([ARRIVAL, self.index, int(tokens), self.version], dtype=torch.float64)
            version, answer = self._call(header, self.wire.encode_up(delta), self.wire.empty())
            self.wire.apply_down(self._held, answer)
            new = self._held
        self._adopt(fragment, version, new)
        self.exchanges += 1
        self.exchange_s += time.monotonic() - started

    def finish(self, fragment: Any) -> None:
        """Say this worker is done, wait for every worker to be, and take the final global weights (the same on
        every rank); then the server stops. Idempotent."""
        if self.finished:
            return
        self.finished = True
        if self.is_server:
            assert self.outer is not None, "start() was not called"
            self._local_done.set()
            while self._thread is not None and self._thread.is_alive():
                # the others may train on for long: the server's own waits (each at most BAGUA_COMM_TIMEOUT_S
                # without a message) bound this one
                self._thread.join(timeout=1.0)
            self._raise_server_error()
            with self._lock:
                version, new = self.outer.version, self.outer.global_.clone()
        else:
            header = torch.tensor([DONE, self.index, 0, self.version], dtype=torch.float64)
            version, new = self._call(header, None, torch.empty(fragment.numel, dtype=torch.float32))
        self._adopt(fragment, version, new)
        self.group = None  # the server's thread has ended (first rank) or will not answer again

    @torch.no_grad()
    def _adopt(self, fragment: Any, version: int, new: torch.Tensor) -> None:
        fragment.global_.copy_(new)
        offset = 0
        for p in fragment.params:
            p.copy_(fragment.global_[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.version = version

    def _call(self, header: torch.Tensor, message: Optional[torch.Tensor],
              answer: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Send ``header`` (and ``message``, a pseudo-gradient) to the server; receive the version and ``answer``
        (the new global weights, or their encoded change; without a message the final float32 weights)."""
        server = self.ranks[0]
        reply = torch.zeros(1, dtype=torch.float64)
        try:
            dist.send(header, server, group=self.group, tag=_TAG_HEADER)
            if message is not None:
                dist.send(message, server, group=self.group, tag=_TAG_DELTA)
            dist.recv(reply, server, group=self.group, tag=_TAG_VERSION)
            dist.recv(answer, server, group=self.group, tag=_TAG_GLOBAL if message is not None else _TAG_FINAL)
        except RuntimeError as e:
            what = "the final global weights" if message is None else "the new global weights"
            raise RuntimeError(
                f"{self.owner}(asynchronous=True): rank {dist.get_rank()} got no answer with {what} from the server "
                f"on rank {server} within {self.timeout_s:.0f} s (BAGUA_COMM_TIMEOUT_S): the server's rank died or "
                "stopped on an error (see its log), or another worker did not call close(), or it trains longer "
                f"than the timeout after this one finished (raise BAGUA_COMM_TIMEOUT_S). Cause: {e}") from e
        return int(reply[0]), answer

    # -- the server (first rank) ------------------------------------------------------------------------------

    def _serve(self, numel: int) -> None:
        assert self.outer is not None and self.wire is not None
        done: set[int] = set()
        header = torch.zeros(4, dtype=torch.float64)
        try:
            while len(done) < len(self.ranks) - 1:
                dist.recv(header, None, group=self.group, tag=_TAG_HEADER)
                kind, worker, tokens, base = (int(v) for v in header.tolist())
                if not 0 < worker < len(self.ranks) or kind not in (ARRIVAL, DONE):
                    raise RuntimeError(f"a header {header.tolist()} that no worker sends: another program sends to "
                                       "this group")
                rank = self.ranks[worker]
                if kind == DONE:
                    done.add(worker)
                    continue
                message = self.wire.empty()
                dist.recv(message, rank, group=self.group, tag=_TAG_DELTA)
                delta = self.wire.decode(message)
                if not bool(torch.isfinite(delta).all()):
                    raise FloatingPointError(f"worker {worker} (rank {rank}) sent a pseudo-gradient holding NaN or Inf")
                with self._lock:
                    arrival = self.outer.apply(worker, tokens, base, delta)
                    new = self.outer.global_.clone()
                self._log(arrival)
                answer = self.wire.encode_down(new, self._mirrors[worker]) if self.wire.compressed else new
                self._reply(rank, arrival.version, answer, _TAG_GLOBAL)
            while not self._local_done.wait(timeout=1.0):
                pass  # the first rank's own worker trains on; it sets the event in finish()
            with self._lock:
                version, new = self.outer.version, self.outer.global_.clone()
            for rank in self.ranks[1:]:
                self._reply(rank, version, new, _TAG_FINAL)
        except BaseException as e:  # noqa: BLE001 - kept, raised on the first rank's next exchange or finish
            self._error = e
            logger.error("%s(asynchronous=True): the server on rank %d stopped: %r", self.owner, self.ranks[0], e)

    @staticmethod
    def _log(a: Arrival) -> None:
        logger.info("asynchronous DiLoCo: version %d from worker %d (%d tokens, started from %d: staleness %d, "
                    "weight %.3f)", a.version, a.worker, a.tokens, a.base, a.staleness, a.weight)

    def _reply(self, rank: int, version: int, answer: torch.Tensor, tag: int) -> None:
        dist.send(torch.tensor([version], dtype=torch.float64), rank, group=self.group, tag=_TAG_VERSION)
        dist.send(answer, rank, group=self.group, tag=tag)

    def _raise_server_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"{self.owner}(asynchronous=True): the server on rank {self.ranks[0]} stopped: {self._error}. A "
                f"worker died or sent nothing within {self.timeout_s:.0f} s (BAGUA_COMM_TIMEOUT_S; raise it when a "
                "round can take longer)") from self._error
