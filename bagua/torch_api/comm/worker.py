"""The communication thread: one daemon thread that runs communication jobs in submission order.

An engine runs its buckets' operations on one (:class:`CommWorker`), and so do the DDP hooks, optimizers and
replica groups of ``contrib`` and ``sharded`` that overlap their exchanges with training. A :class:`CommJob` is
one function on such a thread, ordered after the caller's CUDA work; :func:`wait_or_raise` turns a timeout or a
failure into an error that names the rank and the job. At interpreter exit every live thread is stopped (see
:func:`bagua.torch_api.comm.lifecycle.on_shutdown`, order 0: before the groups they use are released).

Example:
    >>> worker = CommWorker("example", stream=None)
    >>> CommJob(worker, lambda: None, "a no-op").wait(5.0)
    >>> worker.close(join_timeout_s=1.0)
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.comm.lifecycle import on_shutdown

__all__ = ["CommWorker", "CommJob", "wait_or_raise"]


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


def _close_workers_at_exit() -> None:
    for worker in list(_live_workers):
        worker.close(join_timeout_s=1.0)


on_shutdown(_close_workers_at_exit, order=0)
