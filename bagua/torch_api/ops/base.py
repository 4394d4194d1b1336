"""The one interface of a bucket operation: :class:`BucketOp`.

A bucket runs its operations in order as ``op(bucket, flat)`` on its flat tensor; the engine and the algorithms
reach what an operation offers beyond that (error-feedback state, rollback after a non-finite step, an
asynchronous launch) only through the methods declared here, whose defaults say "nothing to do". A plain callable
``fn(bucket, flat)`` becomes an operation through :class:`FunctionOp` (``BaguaBucket.append_op`` wraps it).

Example:
    >>> op = FunctionOp(lambda bucket, flat: flat.mul_(2))
    >>> t = torch.ones(2)
    >>> op(None, t); t
    tensor([2., 2.])
    >>> op.accepts_pending, op.launches_async, op.state_dict()
    (False, False, {})
"""

from __future__ import annotations

import abc
import datetime
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.interfaces import Bucket

__all__ = ["AsyncHandle", "BucketOp", "FunctionOp"]


class AsyncHandle:
    """A collective started asynchronously, and what to do once it has finished."""

    __slots__ = ("work", "finish")

    def __init__(self, work: Optional[dist.Work], finish: Optional[Callable[[], object]]) -> None:
        self.work = work
        self.finish = finish

    def wait(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` seconds for the collective, then run ``finish``."""
        if self.work is not None:
            self.work.wait(datetime.timedelta(seconds=timeout_s))
        if self.finish is not None:
            self.finish()


class BucketOp(abc.ABC):
    """One operation of a bucket, run as ``op(bucket, flat)`` on the bucket's flat tensor.

    Subclasses implement :meth:`__call__` and override what they offer of the rest.

    Attributes:
        accepts_pending: the operation reads fresh gradients not yet copied into the flat buffer through
            ``bucket.pieces`` and writes its result into the flat buffer (see ``BaguaBucket.defer_restore``);
            only a bucket's first operation is asked.
        launches_async: :meth:`launch_async` can run the whole operation as one collective started from the
            caller's thread (the engine then skips its communication thread).
    """

    accepts_pending: bool = False
    launches_async: bool = False

    @abc.abstractmethod
    def __call__(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Run the operation on ``flat``, the bucket's flat tensor."""

    def launch_async(self, bucket: Bucket, flat: torch.Tensor) -> AsyncHandle:
        """Start the operation as one collective and return its handle (only when :attr:`launches_async`)."""
        raise NotImplementedError(f"{type(self).__name__} has no asynchronous launch")

    def reset(self) -> None:
        """Return the operation to its initial state (buffers and state built for the buckets dropped)."""

    def rollback(self) -> None:
        """Undo the state changes of the last call (error-feedback residuals after a non-finite step)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return this rank's state that a checkpoint must keep (empty: none)."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned; an operation without state takes only an empty dict."""
        if state:
            raise ValueError(f"{type(self).__name__} holds no state, got {sorted(state)}")


class FunctionOp(BucketOp):
    """A plain callable ``fn(bucket, flat)`` as a :class:`BucketOp` (user-written algorithms append those)."""

    def __init__(self, fn: Callable[[Any, torch.Tensor], Any]) -> None:
        self.fn = fn

    def __call__(self, bucket: Bucket, flat: torch.Tensor) -> None:
        self.fn(bucket, flat)

    def __repr__(self) -> str:
        return f"FunctionOp({self.fn!r})"
