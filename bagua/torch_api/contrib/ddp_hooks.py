"""DDP communication hooks: Bagua's ByteGrad for plain ``torch.nn.parallel.DistributedDataParallel``, and a hook
that keeps gradients local (DiLoCo's inner steps).

Register them where DDP is, ``ddp.register_comm_hook(state, hook)``; Accelerate (``register_comm_hook`` on the
prepared model) and Lightning (``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``, which registers hooks on CUDA
only) pass them through. A snippet per framework: ``docs/integrations.md``. A hook whose job outlives a dead
replica (each worker its own DDP world): :mod:`~bagua.torch_api.contrib.ddp_fault`.

ByteGrad = MinMaxUInt8 around a scatter-reduce-gather allreduce
(:func:`~bagua.torch_api.codecs.compressed_allreduce.low_precision_allreduce_inplace`, or with ``codec="uint8"``/``"uint4"``
one min/max per block, :func:`~bagua.torch_api.codecs.block_allreduce.block_allreduce_inplace`; Bagua paper:
https://arxiv.org/abs/2107.01499): the maths of :class:`~bagua.torch_api.algorithms.bytegrad.ByteGradAlgorithm`
(flat, averaged), applied to DDP's buckets. For each bucket:

1. DDP calls :func:`bytegrad_hook` from backward once the bucket is complete; the hook queues the bucket on the
   state's communication thread and returns a ``torch.futures.Future`` at once, so backward goes on;
2. the thread runs the 8-bit allreduce over the state's own process group: the bucket (padded with zeros to a
   multiple of the group size) splits into one chunk per rank; each chunk is encoded with its own min/max, sent
   to its owner, decoded and averaged there in rank order, encoded again and all-gathered. Buckets run one after
   the other in DDP's bucket order, which is the same on every rank;
3. the thread completes the future with the averaged bucket; DDP waits for it at the end of backward and writes
   it to the gradients.

Why a thread: torch's ``powerSGD_hook`` waits for a collective inside a future callback, which gloo runs on its
own worker threads, so two buckets in flight block both of them and the step deadlocks. Here nothing waits on
gloo's threads, and the exchange runs on a group that nothing else uses (created, collectively, when the state
is built).

Non-finite gradients: a NaN/Inf makes its chunk's min/max non-finite, so the chunk decodes to non-finite values on
every rank and ``torch.amp.GradScaler`` skips the step everywhere, as under DDP's allreduce; the error-feedback
residuals keep their values from before that step. ``no_sync()`` works as with any hook: DDP calls none inside it,
and the accumulated gradients are sent at the next synchronizing backward.

QAdam has no hook here: after its warm-up what travels is the Adam momentum, which lives in the optimizer, not in
DDP's gradient buckets; use ``with_bagua`` with :class:`~bagua.torch_api.algorithms.q_adam.QAdamAlgorithm`.

Example:
    >>> from bagua.torch_api.contrib.ddp_hooks import ByteGradState, bytegrad_hook
    >>> ddp = torch.nn.parallel.DistributedDataParallel(model)  # doctest: +SKIP
    >>> ddp.register_comm_hook(ByteGradState(), bytegrad_hook)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.algorithms.checks import check_bool
from bagua.torch_api.codecs.block import DEFAULT_BLOCK
from bagua.torch_api.codecs.compressed_allreduce import all_finite
from bagua.torch_api.codecs.workspace import AnyWorkspace, compressed_allreduce_inplace, make_workspace
from bagua.torch_api.ops.compressed import CODECS as GRADIENT_CODECS
from bagua.torch_api.ops.compressed import check_codec
from bagua.torch_api.comm.own_group import group_ranks, own_communicator, release_at_exit
from bagua.torch_api.comm.worker import CommJob, CommWorker
from bagua.torch_api.comm.process_group import BaguaCommunicator

__all__ = ["CODECS", "ByteGradState", "bytegrad_hook", "LocalState", "local_hook"]

logger = logging.getLogger(__name__)

#: Codecs of :class:`ByteGradState`, as ``ByteGradAlgorithm(codec=...)``: ``"chunk"`` (8 bits per value, a min/max
#: per rank chunk; ``"minmax_uint8"`` is its former name here), ``"uint8"`` and ``"uint4"`` (a min/max per block).
CODECS = GRADIENT_CODECS


class ByteGradState:
    """The state of :func:`bytegrad_hook`: its process group, thread, buffers and error-feedback residuals.

    Building it is collective (it creates a process group of its own): every rank of the job builds it, in the same
    order relative to other groups. Built before ``torch.distributed`` is initialized (as Lightning builds
    ``DDPStrategy(ddp_comm_state=...)``), it creates its group when DDP hands it the first bucket.

    Args:
        process_group: the ranks to average over: ``None`` (the default group, as DDP's), a torch
            ``ProcessGroup`` or a :class:`~bagua.torch_api.comm.process_group.BaguaProcessGroup`; pass DDP's
            ``process_group`` if you gave it one.
        error_feedback: add each rank's quantization error of the previous steps to its bucket before encoding
            (and the chunk owners' error of the second quantization likewise; EF-SGD,
            https://arxiv.org/abs/1901.09847); costs a float32 copy of the gradients. DDP rebuilds its buckets once,
            after the first iteration: the residuals restart then.
        codec: a gradient codec of the codec registry: ``"chunk"`` (the default: ByteGrad's original code, one
            min/max per rank chunk; ``"minmax_uint8"`` and ``"MinMaxUInt8"`` are its aliases), ``"uint8"`` (one
            min/max per block of ``block_size`` elements) or ``"uint4"`` (block-wise, 4 bits per value); see
            :mod:`~bagua.torch_api.algorithms.bytegrad`.
        block_size: elements per block of ``"uint8"``/``"uint4"`` (even).
        grad_scaler: the ``torch.amp.GradScaler`` scaling the loss, with error feedback: when its scale changes the
            residuals (kept in units of scaled gradients) are multiplied by ``new_scale / old_scale``.
        fault_tolerance: refused with a ``ValueError`` (this state averages over one torch world, which dies with
            any of its workers): use :class:`~bagua.torch_api.contrib.ddp_fault.FaultTolerantHookState` (one DDP
            world per worker; docs/fault_tolerance.md, "Synchronous jobs").

    Attributes (stats, read them at any time): ``iter`` (backward passes that communicated), ``buckets`` (buckets
    averaged), ``bytes_sent`` (bytes this rank sent), ``nonfinite_buckets`` (buckets whose result held NaN/Inf).

    Example:
        >>> state = ByteGradState(error_feedback=True)  # doctest: +SKIP
        >>> ddp.register_comm_hook(state, bytegrad_hook)  # doctest: +SKIP
    """

    __slots__ = (
        # user hyper-parameters
        "process_group", "error_feedback", "codec", "block_size", "grad_scaler",
        # internal state
        "ranks", "_communicator", "_worker", "_workspaces", "_layouts", "_scale",
        # stats
        "iter", "buckets", "bytes_sent", "nonfinite_buckets",
        "__weakref__",
    )

    def __init__(self, process_group: Any = None, error_feedback: bool = False, codec: str = "chunk",
                 block_size: int = DEFAULT_BLOCK, grad_scaler: Any = None, fault_tolerance: Any = None) -> None:
        if fault_tolerance is not None:
            raise ValueError("ByteGradState(fault_tolerance=...): this state averages over one torch world, which "
                             "dies with any worker; for DDP that outlives a dead replica build DDP in a world of "
                             "this process alone and register bagua.torch_api.contrib.ddp_fault."
                             "FaultTolerantHookState(ft, ddp, optimizer, codec='uint8') with fault_tolerant_hook")
        check_bool("ByteGradState", "error_feedback", error_feedback)
        codec = check_codec("ByteGradState", codec, block_size)  # an alias ("minmax_uint8", "MinMaxUInt8") -> "chunk"
        self.process_group = process_group
        self.error_feedback = error_feedback
        self.codec = codec
        self.block_size = block_size
        self.grad_scaler = grad_scaler
        self.ranks: Optional[list[int]] = None
        self._communicator: Optional[BaguaCommunicator] = None
        if process_group is not None or dist.is_initialized():
            self._bind()
        # else: built before torch.distributed (Lightning builds a strategy's arguments before its processes
        # rendezvous): the group is created at the first bucket, which every rank's DDP hands over first
        self._worker: Optional[CommWorker] = None  # started at the first bucket, when its device is known
        self._workspaces: dict[int, AnyWorkspace] = {}  # bucket index -> buffers, residuals
        self._layouts: dict[int, tuple[int, ...]] = {}  # bucket index -> its parameters (error feedback only)
        self._scale: Optional[float] = None  # the scaler's scale in this backward (read at its first bucket)
        self.iter = 0
        self.buckets = 0
        self.bytes_sent = 0
        self.nonfinite_buckets = 0
        release_at_exit(self)

    def _bind(self) -> None:
        """Create the state's own process group (collective)."""
        self.ranks = group_ranks(self.process_group, "ByteGradState")
        self._communicator = own_communicator(self.ranks)

    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Queue ``bucket`` on the communication thread; return the future of its averaged buffer."""
        if self._communicator is None:
            self._bind()
        flat = bucket.buffer()
        index = bucket.index()
        # which parameters the bucket holds matters only to residuals, which are per element
        layout = tuple(id(p) for p in bucket.parameters()) if self.error_feedback else ()
        if self.grad_scaler is not None and self.error_feedback and self._scale is None:
            self._scale = float(self.grad_scaler.get_scale())  # on the backward's thread, at its first bucket
        scale = self._scale
        if bucket.is_last():
            self.iter += 1
            self._scale = None  # read again in the next backward (GradScaler.update() may change it)
        future: torch.futures.Future = torch.futures.Future(devices=[flat.device] if flat.is_cuda else None)
        if self._worker is None:
            stream = torch.cuda.Stream() if flat.is_cuda else None
            self._worker = CommWorker(f"bagua-bytegrad-hook-{id(self):x}", stream)
        CommJob(self._worker, lambda: self._average(index, flat, layout, future, scale),
                f"ByteGrad hook, bucket {index}", cuda=flat.is_cuda)
        return future

    def _average(self, index: int, flat: torch.Tensor, layout: tuple[int, ...], future: torch.futures.Future,
                 scale: Optional[float] = None) -> None:
        """Average ``flat`` in 8 bits and complete ``future`` with it (runs on the communication thread)."""
        try:
            ws = self._workspace(index, flat, layout)
            ws.follow_scale(scale)  # the residuals follow the gradients' units
            finite = compressed_allreduce_inplace(flat, ws, self._communicator, error_feedback=self.error_feedback,
                                                  tag=index)
            if finite is None and self.codec != "chunk":  # the block codecs' verdict is read from the result
                finite = all_finite(flat)  # identical bytes on every rank: the same verdict everywhere
            if finite is False:
                ws.rollback()  # the residuals would now hold this step's NaN: keep those of the step before
                self.nonfinite_buckets += 1
            self.buckets += 1
            self.bytes_sent += ws.bytes_sent()
            future.set_result(flat)
        except BaseException as exc:  # noqa: BLE001 - DDP raises it from its wait, on the training thread
            future.set_exception(exc)

    def _workspace(self, index: int, flat: torch.Tensor, layout: tuple[int, ...]) -> AnyWorkspace:
        ws = self._workspaces.get(index)
        n = self._communicator.nranks()  # type: ignore[union-attr]
        if ws is None or ws.numel != flat.numel() or self._layouts.get(index) != layout or ws.device not in (
                None, flat.device):
            if ws is not None and self.error_feedback:
                logger.debug("ByteGrad hook: DDP rebuilt bucket %d; its error-feedback residuals restart", index)
            ws = make_workspace(self.codec, flat.numel(), n, flat.device, self.block_size, self.error_feedback)
            self._workspaces[index] = ws
            self._layouts[index] = layout
        return ws

    def close(self) -> None:
        """Stop the communication thread once the buckets it holds are done (the state is not usable after)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        self._workspaces.clear()

    def _release_for_exit(self) -> None:
        if self._worker is not None:
            self._worker.close(join_timeout_s=1.0)
            self._worker = None
        self._communicator = None  # the group is freed while the interpreter is whole

    def __repr__(self) -> str:
        return (f"ByteGradState(ranks={self.ranks}, error_feedback={self.error_feedback}, codec={self.codec!r}, "
                f"iter={self.iter}, bytes_sent={self.bytes_sent})")


def bytegrad_hook(state: ByteGradState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP bucket in 8 bits: MinMaxUInt8 around a scatter-reduce-gather allreduce (ByteGrad).

    Args:
        state: a :class:`ByteGradState` (built on every rank).
        bucket: the bucket DDP hands over.

    Returns:
        A future of the averaged bucket, completed by the state's communication thread.

    Example:
        >>> ddp.register_comm_hook(ByteGradState(), bytegrad_hook)  # doctest: +SKIP
    """
    return state.submit(bucket)


class LocalState:
    """The state of :func:`local_hook`: how many backward passes still average their gradients first.

    As torch's ``PostLocalSGDState(start_localSGD_iter=...)``: DDP averages the gradients (float32 allreduce, as its
    default hook) for the first ``warmup_steps`` backward passes that synchronize, then keeps them local. Pass the
    same ``warmup_steps`` to :class:`~bagua.torch_api.contrib.DiLoCoOptimizer`.

    Args:
        warmup_steps: backward passes (optimizer steps) of gradient averaging before the local ones.
        process_group: the group of the warm-up allreduce (``None``: the default group).

    Example:
        >>> ddp.register_comm_hook(LocalState(warmup_steps=100), local_hook)  # doctest: +SKIP
    """

    __slots__ = ("warmup_steps", "process_group", "iter")

    def __init__(self, warmup_steps: int = 0, process_group: Optional[dist.ProcessGroup] = None) -> None:
        from bagua.torch_api.algorithms.checks import check_int

        check_int("LocalState", "warmup_steps", warmup_steps, 0, "backward passes that average gradients first")
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.iter = 0  # backward passes that synchronized (counted at the last bucket)


def local_hook(state: Optional[LocalState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Leave a DDP bucket as it is: each rank keeps its own gradient (DiLoCo's inner steps, local SGD).

    With a :class:`LocalState` whose warm-up is not over, average the bucket instead (torch's ``allreduce_hook``).
    ``state=None`` is local from the first step, like torch's ``noop_hook``.

    Args:
        state: ``None`` or a :class:`LocalState`.
        bucket: the bucket DDP hands over.

    Returns:
        A completed future of the bucket's own gradient (or the future of its allreduce during the warm-up).

    Example:
        >>> ddp.register_comm_hook(None, local_hook)  # doctest: +SKIP
    """
    if state is not None:
        warm = state.iter < state.warmup_steps
        if bucket.is_last():
            state.iter += 1
        if warm:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            return allreduce_hook(state.process_group, bucket)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# DDP compares a hook's annotations with the classes themselves, and this module's are strings (PEP 563)
for _hook in (bytegrad_hook, local_hook):
    _hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
del _hook
