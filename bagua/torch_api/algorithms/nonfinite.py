"""Non-finite gradients (NaN/Inf): every rank reaches the same verdict and acts alike.

Mixed precision makes overflow an ordinary event: ``torch.amp.GradScaler`` looks for Inf/NaN in each optimizer's
gradients after ``unscale_`` and skips that optimizer's step when it finds some. Under DDP the Inf of one rank
reaches every rank through the allreduce, so every rank skips the same step and lowers its scale alike. Bagua
keeps that contract for every algorithm:

- gradient allreduce: the allreduce spreads the Inf exactly as DDP's does;
- 8-bit compression (ByteGrad, QAdam): a non-finite value makes its chunk's min/max non-finite, so the chunk
  decodes to non-finite values on every rank (identical bytes everywhere); the verdict is read from the chunks'
  headers (:class:`FiniteVerdicts`) and :func:`check_finite_after_communication` applies the user's policy;
- algorithms whose gradients stay local (decentralized, low-precision decentralized, QAdam after its warmup):
  :func:`agree_on_finite_gradients` runs one small MIN-allreduce of a flag per optimizer, and where some rank's
  gradients are not finite, every rank's gradients of that optimizer are set to NaN, so every rank's scaler skips
  that optimizer's step, as under DDP.

Example:
    >>> verdicts = FiniteVerdicts(); verdicts.record("0", True)
    >>> verdicts.take(), verdicts.take()
    ({'0': True}, {})
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.codecs.compressed_allreduce import all_finite

__all__ = [
    "NONFINITE_POLICIES",
    "FiniteVerdicts",
    "check_finite_after_communication",
    "agree_on_finite_gradients",
]

#: What an 8-bit algorithm does when a bucket's result is not finite (see ``ByteGradAlgorithm(nonfinite=...)``).
NONFINITE_POLICIES = ("propagate", "raise", "skip", "ignore")


class FiniteVerdicts:
    """The NaN/Inf verdicts of one step's buckets: recorded on the communication thread as each bucket finishes
    (``on_finite`` of :func:`~bagua.torch_api.ops.compressed.centralized_low_precision_op`), taken by the
    post-backward hook for :func:`check_finite_after_communication`."""

    def __init__(self) -> None:
        self._by_bucket: dict[str, bool] = {}

    def record(self, name: str, finite: bool) -> None:
        """Note bucket ``name``'s verdict."""
        self._by_bucket[name] = finite

    def take(self) -> dict[str, bool]:
        """The verdicts recorded since the last call (bucket name -> finite), forgetting them."""
        taken, self._by_bucket = self._by_bucket, {}
        return taken


def _undo_error_feedback(bagua_ddp: Any) -> None:
    # the residuals of error feedback now hold the bad step's NaN: give them their values from before the step
    # (every rank does, so the step leaves no trace, as if the batch had not been seen)
    for bucket in bagua_ddp.bagua_buckets:
        bucket.rollback()  # only the 8-bit ops with error feedback have something to undo


def check_finite_after_communication(
    bagua_ddp: Any, policy: str, algorithm: str, known: Optional[dict[str, bool]] = None
) -> bool:
    """Apply ``policy`` when a bucket holds NaN or Inf after an 8-bit allreduce; return whether all was finite.

    All ranks hold the same result after the all-gather, so they all reach the same verdict here and act alike
    (no rank is left waiting): ``"propagate"`` leaves the values for ``GradScaler``, ``"raise"`` raises
    ``FloatingPointError``, ``"skip"`` drops every gradient of the step (a plain optimizer then skips every
    parameter), ``"ignore"`` does nothing. Except with ``"ignore"``, the error-feedback residuals get their values
    from before the step back (the step leaves no trace in them). ``known`` maps bucket names to a verdict
    already reached on the communication thread (:class:`FiniteVerdicts`); the other buckets are checked here.
    """
    if policy == "ignore":
        return True
    bad = []
    for bucket in bagua_ddp.bagua_buckets:
        if known is not None and bucket.name in known:
            finite = known[bucket.name]
        else:
            tensors = [bucket.flat] if bucket.flat is not None else [t.effective() for t in bucket.tensors]
            finite = all(all_finite(t) for t in tensors)
        if not finite:
            bad.append(bucket.name)
    if not bad:
        return True
    _undo_error_feedback(bagua_ddp)
    if policy == "propagate":
        return False
    if policy == "raise":
        raise FloatingPointError(
            f"rank {dist.get_rank()}: {algorithm} produced NaN/Inf in bucket(s) {bad}: some rank's gradient was not "
            "finite, and 8-bit compression spreads that to its whole chunk on every rank. Lower the learning rate, "
            "clip gradients, or use torch.amp.GradScaler with the default nonfinite='propagate'"
        )
    for t in bagua_ddp.bagua_tensors:  # "skip": the optimizer skips parameters whose gradient is None
        t.param.grad = None
    return False


def agree_on_finite_gradients(bagua_ddp: Any) -> bool:
    """Make every rank agree, per optimizer, on whether all ranks' gradients are finite; return whether all are.

    One MIN-allreduce of one flag per optimizer on the engine's own group. Where some rank's gradients of an
    optimizer hold NaN/Inf, every rank's gradients of that optimizer are filled with NaN, so that
    ``GradScaler.step`` skips that optimizer on every rank (as the allreduce of DDP would make it), and a
    non-finite step never leaves one rank behind the others.
    """
    optimizers = bagua_ddp.bagua_optimizers
    if not optimizers:
        return True
    grads = [[p.grad for g in o.param_groups for p in g["params"] if p.grad is not None] for o in optimizers]
    flags = [1 if all(all_finite(g) for g in gs) else 0 for gs in grads]
    c = bagua_ddp.process_group.get_global_communicator()
    if c.is_member() and c.nranks() > 1:
        device = next((g.device for gs in grads for g in gs), torch.device("cpu"))
        if dist.get_backend(c.group) == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        agreed = torch.tensor(flags, dtype=torch.int32, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=c.group)
        flags = agreed.tolist()
    for ok, gs in zip(flags, grads):
        if not ok:
            for g in gs:
                g.fill_(float("nan"))
    return all(flags)
