"""Asynchronous model averaging: a background thread averages the weights while training goes on.

Training never waits for communication: every ``sync_interval_ms`` a daemon thread, on a process group of its
own, runs one *round*:

1. negotiate: a MIN-allreduce of a "keep running" flag, so that all ranks stop in the same round as soon as one
   of them calls :meth:`~AsyncModelAverageAlgorithmImpl.abort`;
2. snapshot the weights ``s = x`` (under the weight lock);
3. ``a = allreduce_SUM(s) / n`` (without the lock: training goes on);
4. under the weight lock, ``x += a - s``: the average replaces the snapshot and the local progress made during
   the allreduce is kept.

The training thread holds the weight lock from each training forward to the end of ``optimizer.step()``, so a
round never changes the weights between a forward and the step that uses its gradient, and never races with the
optimizer's in-place update. A waiting round gets the lock before the next forward takes it again.

The first ``warmup_steps`` steps are plain synchronous gradient allreduce.

A rank that stops training must call ``model.bagua_algorithm.abort(model)``: every rank's thread then stops at
the next round and later ``abort`` calls return at once, so ranks may finish at different times without
hanging. ``resume(model)`` restarts averaging and must be called by every rank. At interpreter exit a thread
still running is stopped without any collective (it is a daemon and never keeps the process alive).

Reference: Lian et al., "Asynchronous Decentralized Parallel Stochastic Gradient Descent",
https://arxiv.org/abs/1710.06952.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist

from bagua.torch_api import communication as comm
from bagua.torch_api import env
from bagua.torch_api.algorithms.checks import check_choice, check_int, check_number
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms._weights import _one_bucket_per_dtype, _weight_tensors
from bagua.torch_api.ops.async_average import WeightLock, average_round, flat_like, negotiate
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.interfaces import engine_of
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.tensor import BaguaTensor

__all__ = ["AsyncModelAverageAlgorithm", "AsyncModelAverageAlgorithmImpl"]

logger = logging.getLogger(__name__)

_NEW, _RUNNING, _STOPPED = "new", "running", "stopped"
# The round and the lock live in bagua.torch_api.ops.async_average (shared with BaguaBucket's op appender).
_WeightLock = WeightLock


class AsyncModelAverageAlgorithmImpl(AlgorithmImpl):
    """Asynchronous model averaging bound to a group; see :class:`AsyncModelAverageAlgorithm`."""

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        peer_selection_mode: str = "all",
        sync_interval_ms: int = 500,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__(process_group)
        # user hyper-parameters
        self.peer_selection_mode, self.sync_interval_ms, self.warmup_steps = (peer_selection_mode, sync_interval_ms,
                                                                              warmup_steps)
        # internal state
        self.step_id = 0
        self._warmup = warmup_steps > 0
        self._buckets: list[BaguaBucket] = []
        self._round_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = _WeightLock()
        self._stepped: set[int] = set()  # the optimizers that stepped since the last forward
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._state = _NEW
        self._error: Optional[BaseException] = None
        # the averaging thread's own group, so its collectives never interleave with the training thread's;
        # created collectively with the engine's group (every rank wraps its model at the same time), once: a
        # re-wrap of the model reuses it
        self._ranks = list(process_group.ranks)
        self._thread_group = process_group.auxiliary_group("async-averaging", env.get_comm_timeout_s())
        # stats
        self.rounds = 0
        _live_impls.add(self)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def need_reset(self) -> bool:
        self.step_id += 1
        return self.warmup_steps > 0 and self.step_id == self.warmup_steps + 1

    def init_tensors(self, bagua_ddp) -> list[BaguaTensor]:
        self._warmup = self.step_id < self.warmup_steps
        if self._warmup:
            return super().init_tensors(bagua_ddp)
        return _weight_tensors(bagua_ddp)

    def tensors_to_buckets(self, tensors: Sequence[Sequence[BaguaTensor]], do_flatten: bool) -> list[BaguaBucket]:
        if self._warmup:
            return super().tensors_to_buckets(tensors, do_flatten)
        buckets = _one_bucket_per_dtype(tensors, do_flatten)
        # per bucket, the round's snapshot and average, allocated once
        self._round_buffers = [(flat_like(b), flat_like(b)) for b in buckets]
        self._buckets = buckets
        return buckets

    def init_operations(self, bagua_ddp, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        if self._warmup:
            bucket.append_centralized_synchronous_op(hierarchical=False, average=True, group=self.process_group)

    def init_forward_pre_hook(self, bagua_ddp) -> Callable[[Any], None]:
        if self._warmup:
            return lambda inputs: None

        def hook(inputs: Any) -> None:
            if self.sync_interval_ms <= 0:
                return
            if self._state == _NEW:
                self._start()
            self._report_if_stopped()
            self._stepped.clear()
            self._lock.release_for_training()  # a forward without a step before: let a waiting round in first
            self._lock.acquire_for_training(env.get_comm_timeout_s())

        return hook

    def init_backward_hook(self, bagua_ddp) -> Callable[[str, torch.Tensor], None]:
        if self._warmup:
            return super().init_backward_hook(bagua_ddp)
        return lambda name, param: None

    def init_post_backward_hook(self, bagua_ddp) -> Callable[[], None]:
        if self._warmup:
            return super().init_post_backward_hook(bagua_ddp)
        return lambda: None

    def init_post_optimizer_step_hook(self, bagua_ddp) -> Callable[[torch.optim.Optimizer], None]:
        if self._warmup:
            return lambda optimizer: None

        def hook(optimizer: torch.optim.Optimizer) -> None:
            # with several optimizers, the weights are released once all of them have stepped (by object: a fused
            # optimizer may show other tensors in param_groups while it steps); a round never runs between them
            self._stepped.add(id(optimizer))
            if any(id(o) not in self._stepped for o in bagua_ddp.bagua_optimizers):
                return
            self._stepped.clear()
            self._lock.release_for_training()

        return hook

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}  # nothing of its own, but the ranks' weights differ: checkpoint them per rank

    def close(self) -> None:
        self._stop_thread(raise_on_timeout=False)

    # -- user controls -----------------------------------------------------------------------------------------

    def abort(self, bagua_module: Optional[torch.nn.Module] = None) -> None:
        """Stop averaging on every rank (at the next round); return once this rank's thread has stopped.

        Call it when this rank stops training (and, e.g., before evaluating a final model). A rank whose
        thread was already stopped by a peer's ``abort`` returns at once.

        Args:
            bagua_module: the wrapped module (accepted for compatibility with the original; not needed).
        """
        self._stop_thread(raise_on_timeout=True)

    def resume(self, bagua_module: Optional[torch.nn.Module] = None) -> None:
        """Restart averaging after :meth:`abort`; every rank must call it (its first round waits for all).

        Args:
            bagua_module: the wrapped module (accepted for compatibility with the original; not needed).
        """
        if self._state == _NEW:
            return  # not started yet: the first forward after the warmup starts it
        if self._thread is not None and self._thread.is_alive():
            if not self._stop.is_set():
                return  # running
            self._stop_thread(raise_on_timeout=True)
        self._start()

    def is_averaging(self) -> bool:
        """Whether this rank's averaging thread is running (False before the first async step, after an
        ``abort`` on any rank, or after an error)."""
        return self._thread is not None and self._thread.is_alive()

    # -- the averaging thread -----------------------------------------------------------------------------------

    def _start(self) -> None:
        self._stop.clear()
        self._error = None
        self._state = _RUNNING
        self._thread = threading.Thread(target=self._run_loop, name="bagua-async-model-average", daemon=True)
        self._thread.start()

    def _stop_thread(self, raise_on_timeout: bool, timeout: Optional[float] = None) -> None:
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        self._lock.release_for_training()  # a forward without a step may still hold the weights
        timeout = env.get_comm_timeout_s() if timeout is None else timeout
        thread.join(timeout)
        if thread.is_alive():
            message = (
                f"rank {dist.get_rank()}: the async averaging thread did not stop within {timeout:.0f} s; it waits "
                "for a peer's thread: every rank must call abort() when it stops and resume() to restart"
            )
            if raise_on_timeout:
                raise RuntimeError(message)
            logger.warning(message)
            return
        self._thread = None
        self._state = _STOPPED
        if self._error is not None:
            if raise_on_timeout:  # abort(): the user learns that the last rounds failed
                raise self._peer_error() from self._error
            logger.warning("rank %d: async model averaging had stopped on an error: %r", dist.get_rank(), self._error)

    def _report_if_stopped(self) -> None:
        if self._state != _RUNNING or self._thread is None or self._thread.is_alive():
            return
        self._thread, self._state = None, _STOPPED  # forgetting the thread: reported once
        if self._error is not None:
            # a peer died or is stuck: training alone would silently stop averaging, so stop here, as the
            # synchronous algorithms do when a bucket's collective fails
            raise self._peer_error() from self._error
        logger.warning(
            "rank %d: async model averaging stopped because a peer called abort(); training goes on without "
            "averaging until every rank calls resume()", dist.get_rank(),
        )

    def _peer_error(self) -> RuntimeError:
        me = dist.get_rank()
        peers = [r for r in self._ranks if r != me]
        return RuntimeError(
            f"rank {me}: async model averaging with peer rank(s) {peers} failed: {self._error}. A peer died or is "
            f"stuck (a round waits at most BAGUA_COMM_TIMEOUT_S={env.get_comm_timeout_s():.0f} s); this rank's "
            "weights would no longer be averaged. A rank that stops training early must call "
            "model.bagua_algorithm.abort(model) first"
        )

    def _run_loop(self) -> None:
        try:
            device = self._device()
            if device.type == "cuda":
                torch.cuda.set_device(device)  # a new thread starts on device 0
            while self._negotiate():
                self._average_once()
                self.rounds += 1
                self._stop.wait(self.sync_interval_ms / 1000.0)
        except BaseException as exc:  # noqa: BLE001 - reported to the training thread
            self._error = exc

    def _negotiate(self) -> bool:
        """True while every rank keeps running: a MIN-allreduce of each rank's "keep running" flag."""
        return negotiate(not self._stop.is_set(), self._device(), self._thread_group, len(self._ranks))

    def _average_once(self) -> None:
        """One round: ``s = x``; ``a = mean over ranks of s``; ``x += a - s``."""
        average_round(list(zip(self._buckets, self._round_buffers)), self._lock, self._thread_group, len(self._ranks))

    def _device(self) -> torch.device:
        if self._buckets:
            return self._buckets[0].device
        return torch.device("cuda", torch.cuda.current_device()) if self.process_group.stream is not None else (
            torch.device("cpu")
        )


# Threads still running at interpreter exit are stopped without collectives (peers may be gone already).
_live_impls: "weakref.WeakSet[AsyncModelAverageAlgorithmImpl]" = weakref.WeakSet()


def _stop_all_at_exit() -> None:  # run by Bagua's exit handler, before the process groups are released
    for impl in list(_live_impls):
        impl._stop.set()
        impl._lock.release_for_training()
        if impl._thread is not None:
            impl._thread.join(1.0)


comm.on_shutdown(_stop_all_at_exit, order=0)


@GlobalAlgorithmRegistry.register("async", description="asynchronous model averaging in a background thread")
@dataclass
class AsyncModelAverageAlgorithm(Algorithm):
    """Average weights in a background thread every ``sync_interval_ms`` while training goes on.

    See the module documentation for the numbered steps of a round and the locking. Experimental, as in the
    original: the ranks drift apart between rounds, and the data set is best seen as an endless stream.

    Args:
        peer_selection_mode: ``"all"`` (average over every rank; the only mode).
        sync_interval_ms: milliseconds between two rounds (``0`` never averages, as in the original).
        warmup_steps: run that many steps of synchronous gradient allreduce first.

    Example:
        >>> from bagua.torch_api.algorithms import async_model_average
        >>> algorithm = async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=100)
        >>> model = model.with_bagua([optimizer], algorithm)  # doctest: +SKIP
        >>> # ... train ...
        >>> model.bagua_algorithm.abort(model)  # doctest: +SKIP
    """

    replica_refusal: ClassVar[str] = "its background thread would average weights while FSDP2 all-gathers them"

    peer_selection_mode: str = "all"
    sync_interval_ms: int = 500
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        check_choice("AsyncModelAverageAlgorithm", "peer_selection_mode", self.peer_selection_mode, ("all",))
        check_number("AsyncModelAverageAlgorithm", "sync_interval_ms", self.sync_interval_ms, 0,
                     "milliseconds between two rounds")
        check_int("AsyncModelAverageAlgorithm", "warmup_steps", self.warmup_steps, 0,
                  "steps of gradient allreduce first")
        if self.sync_interval_ms == 0:
            import warnings

            warnings.warn("AsyncModelAverageAlgorithm(sync_interval_ms=0) never averages the weights", stacklevel=3)

    def reify(self, process_group: BaguaProcessGroup) -> AsyncModelAverageAlgorithmImpl:
        return AsyncModelAverageAlgorithmImpl(process_group, **self.hyperparameters())

    def abort(self, bagua_module: torch.nn.Module) -> None:
        """Stop averaging for ``bagua_module`` (same as ``bagua_module.bagua_algorithm.abort(bagua_module)``)."""
        _impl_of(bagua_module).abort(bagua_module)

    def resume(self, bagua_module: torch.nn.Module) -> None:
        """Restart averaging for ``bagua_module`` (same as ``bagua_module.bagua_algorithm.resume(...)``)."""
        _impl_of(bagua_module).resume(bagua_module)


def _impl_of(bagua_module: Any) -> AsyncModelAverageAlgorithmImpl:
    """The implementation behind a wrapped module, a Bagua ``DistributedDataParallel`` or its engine."""
    impl = getattr(engine_of(bagua_module) or bagua_module, "impl", None)
    if not isinstance(impl, AsyncModelAverageAlgorithmImpl):
        raise TypeError(f"{type(bagua_module).__name__} is not trained with AsyncModelAverageAlgorithm")
    return impl
