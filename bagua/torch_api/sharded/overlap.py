"""The replicate-dimension exchanges of sharded replicas, left running while FSDP2's backward goes on.

FSDP2's all-reduce hook hands :class:`~bagua.torch_api.sharded.replicas.ShardedReplicas` each unit's reduce-scatter
output (``reduce_output``). In torch 2.13 (``_fsdp_collectives.foreach_reduce``) the unit's sharded gradients are
``as_strided`` views of that very tensor, so an in-place average that lands after the hook returned is what the
gradients hold, unless FSDP2 copies or changes ``reduce_output`` after the hook. It does so when:

- the reduce dtype is not float32 or bfloat16 (float16: FSDP2 divides by the data-parallel size after the hook),
  or the unit forces sum reductions (``set_force_sum_reduction_for_comms``; the same division);
- the reduce dtype differs from the parameters' (mixed precision: the gradients are a cast copy);
- a parameter of the unit already holds a gradient (accumulation: ``grad += reduce_output``, a copy);
- the unit offloads to CPU (the gradient is a copy on the host);
- a parameter has a post-accumulate-grad hook (it reads the gradient inside the backward).

:func:`can_overlap` answers whether none of these holds for a unit, at the moment of its hook; where one does (or the
unit cannot be read), the exchange runs synchronously inside the hook, as before. Where none does, the exchange is
started (:class:`PendingExchanges`) and waited for at the end of the backward (a callback queued on the autograd
engine, after FSDP2's own), so ``param.grad`` is averaged when ``backward()`` returns, as with native HSDP. Either way
the numbers are the same, bit for bit: the same collective, on the same tensor, with the same inputs. DiLoCo's
warm-up steps (gradients averaged over the replicas) still exchange synchronously in the hook. The conditions were
read from torch 2.13's FSDP2; ``tests/sharded/test_overlap.py`` checks them against the synchronous path.

Example:
    >>> exchanges = PendingExchanges(communicator, "sharded replicas")  # doctest: +SKIP
    >>> exchanges.allreduce_average(reduce_output)  # doctest: +SKIP
    >>> exchanges.wait()  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bagua.torch_api import env
from bagua.torch_api.comm.process_group import BaguaCommunicator
from bagua.torch_api.comm.reduce_op import ReduceOp, finish_avg
from bagua.torch_api.comm.worker import CommJob, CommWorker, wait_or_raise

__all__ = ["PendingExchanges", "can_overlap", "overlap_default"]

#: reduce dtypes FSDP2 divides inside the collective (none after the hook), unless sums are forced
_NO_POST_DIVIDE = (torch.float32, torch.bfloat16)


def overlap_default() -> bool:
    """Whether sharded replicas overlap their exchanges unless told otherwise: ``BAGUA_SHARDED_OVERLAP`` (default
    ``1``; ``0`` runs every exchange synchronously inside FSDP2's hook)."""
    return env.get_bool("BAGUA_SHARDED_OVERLAP", True)


def can_overlap(fsdp_module: Any, reduce_output: torch.Tensor) -> bool:
    """Whether ``fsdp_module``'s sharded gradients are plain views of ``reduce_output`` that FSDP2 leaves untouched
    after its all-reduce hook (see the module docstring for the cases that are not); ``False`` when unsure."""
    try:
        groups = fsdp_module._get_fsdp_state()._fsdp_param_groups
        if len(groups) != 1:
            return False
        group = groups[0]
        reduce_dtype = group._reduce_dtype or reduce_output.dtype
        if reduce_dtype != reduce_output.dtype or reduce_dtype not in _NO_POST_DIVIDE:
            return False
        if group.force_sum_reduction_for_comms or reduce_output.device.type == "mtia":
            return False
        if group._orig_dtype is not None and group._orig_dtype != reduce_dtype:
            return False
        for fsdp_param in group.fsdp_params:
            param = fsdp_param.sharded_param
            if fsdp_param.offload_to_cpu or param.grad is not None or param.dtype != reduce_dtype:
                return False
            if getattr(param, "_post_accumulate_grad_hooks", None):
                return False
        return True
    except AttributeError:  # another torch's FSDP2: run synchronously
        return False


class PendingExchanges:
    """The exchanges of one backward still in flight over ``communicator``, waited for in the order started.

    A float32 (or bfloat16) average is an asynchronous ``all_reduce`` of torch (the division of a backend that sums
    follows at :meth:`wait`, as :func:`~bagua.torch_api.communication.allreduce_inplace` does it); any other
    exchange (ByteGrad's compressed allreduce) runs on a :class:`~bagua.torch_api.comm.worker.CommWorker` thread of
    its own, one at a time in submission order.

    Example:
        >>> exchanges = PendingExchanges(communicator, "sharded replicas")  # doctest: +SKIP
        >>> exchanges.submit(lambda: None, "a no-op", cuda=False)  # doctest: +SKIP
        >>> exchanges.wait()  # doctest: +SKIP
    """

    def __init__(self, communicator: BaguaCommunicator, name: str) -> None:
        self.communicator = communicator
        self.name = name
        self._pending: list[tuple[str, Any, Optional[Callable[[], None]]]] = []
        self._worker: Optional[CommWorker] = None
        #: exchanges started here (left in flight), and the most in flight at once: what overlapped
        self.started = 0
        self.most_in_flight = 0
        #: seconds :meth:`wait` spent blocked on exchanges that had not finished: what did not overlap
        self.wait_s = 0.0

    def __len__(self) -> int:
        return len(self._pending)

    def allreduce_average(self, flat: torch.Tensor) -> None:
        """Start averaging ``flat`` over the communicator in place (what ``allreduce_inplace(flat, AVG)`` does)."""
        c = self.communicator
        if c.group is None or c.nranks() < 2:
            return
        if dist.get_backend(c.group) == "nccl":
            work = dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=c.group, async_op=True)
            finish = None
        else:
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=c.group, async_op=True)

            def finish() -> None:
                finish_avg(flat, ReduceOp.AVG, c.nranks())

        self._add(("work", work, finish))

    def submit(self, fn: Callable[[], None], what: str, cuda: bool) -> None:
        """Run ``fn`` on this object's communication thread (started at the first call)."""
        if self._worker is None:
            self._worker = CommWorker(f"bagua-{self.name.replace(' ', '-')}", None)
        self._add(("job", CommJob(self._worker, fn, what, cuda=cuda), None))

    def _add(self, entry: tuple[str, Any, Optional[Callable[[], None]]]) -> None:
        self._pending.append(entry)
        self.started += 1
        self.most_in_flight = max(self.most_in_flight, len(self._pending))
        # one callback per exchange (the first waits for all, the others find nothing): a backward that fails
        # drops its callbacks, and the next one still queues its own
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.wait)
        except RuntimeError:  # not inside a backward: nothing would wait later, so wait now
            self.wait()

    def wait(self) -> None:
        """Wait for every exchange started, in the order started; raise (naming the rank) if one failed."""
        timeout_s = env.get_comm_timeout_s()
        pending, self._pending = self._pending, []
        if not pending:
            return
        start = time.perf_counter()
        try:
            self._wait_all(pending, timeout_s)
        finally:
            self.wait_s += time.perf_counter() - start

    def _wait_all(self, pending: list[tuple[str, Any, Optional[Callable[[], None]]]], timeout_s: float) -> None:
        for kind, handle, finish in pending:
            if kind == "job":
                handle.wait(timeout_s)
                continue
            wait_or_raise(lambda t: handle.wait(datetime.timedelta(seconds=t)), timeout_s,
                          f"{self.name}: average of a gradient shard over the replicas")
            if finish is not None:
                finish()

    def close(self) -> None:
        """Wait for what is in flight, then stop the communication thread."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._worker.close(join_timeout_s=1.0)
                self._worker = None
