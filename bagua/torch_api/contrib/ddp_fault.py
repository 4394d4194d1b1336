"""A DDP comm hook that outlives a dead replica: each step's gradients averaged over the live workers.

torch ``DistributedDataParallel`` needs one torch world, and a torch world dies with any of its processes. So, as
torchft's fault-tolerant DDP, each worker is a job of its own: one process whose DDP world has size 1 (no
launcher, or a launcher job per worker, restarted alone), and :func:`fault_tolerant_hook` averages the step's
gradients over the live workers through :class:`~bagua.torch_api.fault.synchronous.SyncSteps` and the
coordinator's quorum (:class:`~bagua.torch_api.fault.replica.FaultTolerance`):

1. the forward pre-hook that :class:`FaultTolerantHookState` registers on the DDP module joins the job (a joiner
   heals weights, step counter and the optimizer's whole state from a live peer, at a step boundary) and starts the
   step's agreement on a thread, hidden behind the forward and backward;
2. DDP hands the hook its buckets in order; each gets a future at once, and at the last bucket (every gradient is
   then complete) the round runs over the agreed members: the flat gradient averaged weighted by samples, in
   float32 (``codec=None``: gradient allreduce) or encoded once with a block codec and all-gathered
   (``codec="uint8"``/``"uint4"``: ByteGrad, optional error feedback); if a member died mid-way the survivors run
   the round again without it;
3. only when the round commits is the average written into the buckets; the futures complete and DDP writes it to
   ``.grad``: ``optimizer.step()`` applies the same average on every worker, bit for bit.

Example:
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # this worker alone  # doctest: +SKIP
    >>> ddp = torch.nn.parallel.DistributedDataParallel(model)  # doctest: +SKIP
    >>> ft = FaultTolerance("10.0.0.1:29600", worker="site-a", workers=3)  # doctest: +SKIP
    >>> state = FaultTolerantHookState(ft, ddp, opt)  # codec="uint8": ByteGrad  # doctest: +SKIP
    >>> ddp.register_comm_hook(state, fault_tolerant_hook)  # doctest: +SKIP
    >>> while state.steps.steps < total:  # the job's committed steps, also after a heal  # doctest: +SKIP
    ...     opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step()
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.algorithms.checks import check_bool
from bagua.torch_api.algorithms.fault_steps import check_fault_tolerance
from bagua.torch_api.codecs.block import DEFAULT_BLOCK
from bagua.torch_api.codecs.registry import GlobalCodecRegistry
from bagua.torch_api.fault.synchronous import SyncSteps

__all__ = ["FaultTolerantHookState", "fault_tolerant_hook"]

_log = logging.getLogger(__name__)


def _check(ddp: Any, optimizer: Any, codec: Optional[str], error_feedback: bool) -> None:
    """Refuse, before anything is built, what the hook does not run, saying what to do."""
    owner = "FaultTolerantHookState"
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(f"{owner}(ft, ddp, ...) takes the torch DistributedDataParallel module the hook is "
                         f"registered on (its forward pre-hook starts each step's agreement), got {type(ddp)!r}")
    size = ddp.process_group.size()
    if size != 1:
        raise ValueError(f"{owner}: each worker is one replica (a job of its own), but this DDP's group has {size} "
                         "ranks: build DDP in a torch world of this process alone, e.g. "
                         "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"{owner}(ft, ddp, optimizer): a joiner heals with one torch optimizer's state; got "
                         f"{type(optimizer)!r}")
    check_bool(owner, "error_feedback", error_feedback)
    if codec is not None and GlobalCodecRegistry.get(codec).block_codec is None:
        raise ValueError(f"{owner}(codec={codec!r}): the live workers' gradients are all-gathered, which needs a "
                         "block codec; pass codec='uint8' (8 bits, one min/max per block), codec='uint4', or None "
                         "(float32)")
    if codec is None and error_feedback:
        raise ValueError(f"{owner}(error_feedback=True) needs a codec: float32 has no quantization error; pass "
                         "codec='uint8' or error_feedback=False")


class FaultTolerantHookState:
    """The state of :func:`fault_tolerant_hook`: this worker's steps over the live workers, and the step's buckets.

    Building it registers a forward pre-hook on ``ddp`` (removed by :meth:`close`) and the state callbacks of a
    heal on ``ft``; register the hook yourself, ``ddp.register_comm_hook(state, fault_tolerant_hook)``.

    Args:
        ft: this worker's :class:`~bagua.torch_api.fault.replica.FaultTolerance`.
        ddp: the ``DistributedDataParallel`` module, in a torch world of this process alone.
        optimizer: the one optimizer stepping ``ddp``'s parameters (its whole state heals a joiner).
        codec: ``None`` (float32 average: gradient allreduce) or a block codec of the registry (``"uint8"``,
            ``"uint4"``: ByteGrad, encoded once and all-gathered, decoded in member order).
        block_size: elements per block of the codec.
        error_feedback: with a codec, add this worker's quantization error of earlier committed steps.

    Attributes: ``steps`` (the :class:`~bagua.torch_api.fault.synchronous.SyncSteps`: ``steps.steps`` is the job's
    committed steps, also after a heal), ``iter`` (backward passes averaged), ``buckets`` (buckets completed).

    Example:
        >>> state = FaultTolerantHookState(ft, ddp, opt, codec="uint8", error_feedback=True)  # doctest: +SKIP
        >>> ddp.register_comm_hook(state, fault_tolerant_hook)  # doctest: +SKIP
    """

    __slots__ = (
        # user settings
        "ft", "codec", "block_size", "error_feedback",
        # internal state
        "steps", "_handle", "_waiting",
        # stats
        "iter", "buckets",
        "__weakref__",
    )

    def __init__(self, ft: Any, ddp: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 codec: Optional[str] = None, block_size: int = DEFAULT_BLOCK, error_feedback: bool = False) -> None:
        check_fault_tolerance("FaultTolerantHookState", ft, True)
        _check(ddp, optimizer, codec, error_feedback)
        self.ft, self.codec, self.block_size, self.error_feedback = ft, codec, block_size, error_feedback
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        params = [p for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored]
        if not params:
            raise ValueError("FaultTolerantHookState: the model has no trainable parameter")
        self.steps = SyncSteps(ft, params, optimizer, codec=codec, block_size=block_size,
                               error_feedback=error_feedback, name="FaultTolerantHookState",
                               buffers=list(ddp.module.buffers()))
        self._handle = ddp.register_forward_pre_hook(self._on_forward_pre)
        self._waiting: list[tuple[dist.GradBucket, torch.futures.Future]] = []  # this backward's buckets
        self.iter = 0
        self.buckets = 0

    def _on_forward_pre(self, module: torch.nn.Module, inputs: Any) -> None:
        self.steps.before_forward()  # join at a step boundary; the step's agreement starts on a thread

    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Hold ``bucket``'s future; at the last bucket run the step's round and complete every future."""
        flat = bucket.buffer()
        if bucket.index() == 0:
            self._waiting = []  # a backward that stopped half-way left buckets here: DDP waits on none of them
        future: torch.futures.Future = torch.futures.Future(devices=[flat.device] if flat.is_cuda else None)
        self._waiting.append((bucket, future))
        if bucket.is_last():
            waiting, self._waiting = self._waiting, []
            self._finish(waiting)
        return future

    def _finish(self, waiting: list[tuple[dist.GradBucket, torch.futures.Future]]) -> None:
        """Average the step over the live workers (every gradient is complete at the last bucket; each
        parameter's ``.grad`` holds it, as DDP copies a gradient into its bucket) and write it into the buckets."""
        try:
            self.steps.after_backward()  # .grad <- the committed average (retried without the dead)
            with torch.no_grad():
                for bucket, _ in waiting:
                    for p, view in zip(bucket.parameters(), bucket.gradients()):
                        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                            view.copy_(p.grad.reshape(view.shape))
        except BaseException as exc:  # noqa: BLE001 - DDP raises it from its wait, on the training thread
            for _, future in waiting:
                future.set_exception(exc)
            return
        self.iter += 1
        for bucket, future in waiting:
            future.set_result(bucket.buffer())
            self.buckets += 1

    def close(self) -> None:
        """Remove the forward pre-hook (the state steps no more; call ``ft.close()`` when the training ends)."""
        self._handle.remove()

    def __repr__(self) -> str:
        return (f"FaultTolerantHookState(worker={self.ft.worker!r}, codec={self.codec!r}, "
                f"steps={self.steps.steps}, iter={self.iter})")


def fault_tolerant_hook(state: FaultTolerantHookState,
                        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP bucket over the step's live workers (gradient allreduce, or ByteGrad with a block codec).

    Args:
        state: a :class:`FaultTolerantHookState` built on this worker's DDP module.
        bucket: the bucket DDP hands over.

    Returns:
        A future of the bucket's average, completed when the step's last bucket has been averaged and committed.

    Example:
        >>> ddp.register_comm_hook(FaultTolerantHookState(ft, ddp, opt), fault_tolerant_hook)  # doctest: +SKIP
    """
    return state.submit(bucket)


# DDP compares a hook's annotations with the classes themselves, and this module's are strings (PEP 563)
fault_tolerant_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
