"""The engine's communication plane: its own process groups and its communication thread.

What an engine sends belongs to it alone. :func:`private_group` gives each wrapped model torch groups of its own
over the user's ranks (created collectively at wrap time, kept per module so a re-wrap reuses them), so nothing it
sends can interleave with the user's collectives, Lightning's, another wrapped model's or an asynchronous
background round. :class:`CommWorker` is the thread that runs the buckets' operations, in submission order.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api import communication as comm
from bagua.torch_api.comm.process_group import BaguaProcessGroup

__all__ = ["private_group", "enable_multistream_like", "CommWorker", "CommJob", "register_engine", "is_engine",
           "wait_or_raise"]

_engine_count = 0  # private groups created in this process; the same on every rank, since wrapping is collective
_private_groups: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def private_group(module: torch.nn.Module, group: BaguaProcessGroup) -> BaguaProcessGroup:
    """The engine's own copy of ``group`` (collective the first time), per module: a re-wrap reuses it, so
    wrapping a model again and again creates no new connections or threads."""
    global _engine_count
    cached = _private_groups.setdefault(module, {})
    key = (tuple(group.ranks), group.group_name, id(group))
    if key not in cached:
        _engine_count += 1
        cached[key] = group.private_copy(f"engine{_engine_count}")
    return cached[key]

def enable_multistream_like(user_group: BaguaProcessGroup, own_group: BaguaProcessGroup) -> None:
    """Carry ``multistream.enable(user_group)`` (several TCP streams, e.g. for the default group) over to the
    engine's own group, with the same number of streams (collective, like the enable call itself)."""
    from bagua.torch_api import multistream

    msg = multistream.get(user_group)
    if msg is not None and multistream.get(own_group) is None:
        own = multistream.enable(own_group, num_streams=msg.max_streams, min_chunk_bytes=msg.min_chunk_bytes,
                                 calibrate_streams=False)
        own.num_streams = msg.num_streams


class CommWorker:
    """A daemon thread that executes buckets one at a time, in submission order."""

    def __init__(self, name: str, stream: Optional[Any]) -> None:
        self._stream = stream
        self._jobs: list[tuple[Callable[[], None], Future]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._device = torch.cuda.current_device() if stream is not None else None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _live_workers.add(self)

    def submit(self, fn: Callable[[], None]) -> Future:
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the communication thread is closed")
            self._jobs.append((fn, future))
            self._cv.notify()
        return future

    def _loop(self) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                fn, future = self._jobs.pop(0)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        fn()
                else:
                    fn()
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(exc)

    def close(self, join_timeout_s: Optional[float] = None) -> None:
        """Stop the thread once its queued jobs are done (waiting at most ``join_timeout_s`` when given)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if join_timeout_s is not None:
            self._thread.join(join_timeout_s)


class CommJob:
    """A function running on a :class:`CommWorker`, ordered after the main thread's CUDA work queued so far.

    :meth:`wait` returns once it has finished (its CUDA work included, for the caller's stream), raising a
    ``RuntimeError`` that names the rank and ``what`` when it failed or did not finish within the timeout.

    Args:
        worker: the thread to run on.
        fn: the function.
        what: what it does, for error messages ("DiLoCo exchange of fragment 0 of model M").
        cuda: whether ``fn`` touches CUDA tensors (events then order it after, and before, the caller's stream).
    """

    __slots__ = ("future", "done_event", "what")

    def __init__(self, worker: CommWorker, fn: Callable[[], None], what: str, cuda: bool = False) -> None:
        ready_event = done_event = None
        if cuda:
            ready_event, done_event = torch.cuda.Event(), torch.cuda.Event()
            ready_event.record()

        def run() -> None:
            if ready_event is not None:
                torch.cuda.current_stream().wait_event(ready_event)
            fn()
            if done_event is not None:
                done_event.record()

        self.what = what
        self.done_event = done_event
        self.future = worker.submit(run)

    def done(self) -> bool:
        """Whether the function has returned (or raised)."""
        return self.future.done()

    def wait(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` seconds; raise if the function failed or is still running."""
        wait_or_raise(self.future.result, timeout_s, self.what)
        if self.done_event is not None:
            torch.cuda.current_stream().wait_event(self.done_event)


def wait_or_raise(wait: Callable[[float], object], timeout_s: float, what: str) -> None:
    """Call ``wait(timeout_s)``; turn a timeout or a failure into a ``RuntimeError`` that names the rank and ``what``.

    Example:
        >>> wait_or_raise(lambda timeout: None, 1.0, "nothing")
    """
    try:
        wait(timeout_s)
    except FutureTimeout:
        raise RuntimeError(
            f"rank {_rank()}: {what} did not finish within {timeout_s:.0f} s; a peer may be dead or stuck. "
            "Set BAGUA_COMM_TIMEOUT_S to change the limit."
        ) from None
    except Exception as exc:
        raise RuntimeError(
            f"rank {_rank()}: {what} failed: {exc}. If a peer died or is stuck, this fails after "
            f"BAGUA_COMM_TIMEOUT_S={timeout_s:.0f} s."
        ) from exc


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


_live_workers: "weakref.WeakSet[CommWorker]" = weakref.WeakSet()
_live_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register_engine(engine: Any) -> None:
    """Let the exit handler release ``engine``'s process groups (see :func:`bagua.torch_api.comm.lifecycle._shutdown`)."""
    _live_engines.add(engine)


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` is an engine (a ``BaguaDistributedDataParallel``) created in this process."""
    return obj in _live_engines


def open_engines_of(module: Any) -> list:
    """The engines that train ``module`` and are not closed (at most one, see the engine's constructor)."""
    return [e for e in list(_live_engines) if getattr(e, "module", None) is module and not e.closed]


def _close_workers_at_exit() -> None:
    for worker in list(_live_workers):
        worker.close(join_timeout_s=1.0)


def _release_groups_at_exit() -> None:
    # a group's C++ threads are joined when the group is freed: drop every reference the engines hold
    for engine in list(_live_engines):
        engine._release_for_exit()
    _private_groups.clear()


comm.on_shutdown(_close_workers_at_exit, order=0)
comm.on_shutdown(_release_groups_at_exit, order=1)
