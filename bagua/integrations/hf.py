"""Bagua under a Hugging Face ``transformers.Trainer``: :class:`BaguaCallback`.

A ``TrainerCallback``, the Trainer's extension point. When training begins it registers Bagua on the model the
Trainer wrapped in torch DDP (what the Trainer does with several processes, e.g. under ``torchrun``):

- ``algorithm="bytegrad"``: Bagua's 8-bit gradient averaging as a DDP comm hook
  (:class:`~bagua.torch_api.contrib.ddp_hooks.ByteGradState`, :func:`~bagua.torch_api.contrib.ddp_hooks.bytegrad_hook`);
  every rank keeps the same weights, as under DDP;
- ``algorithm="diloco"``: DiLoCo. DDP keeps the gradients local (:func:`~bagua.torch_api.contrib.ddp_hooks.local_hook`,
  after ``warmup_steps`` averaged ones) and a :class:`~bagua.torch_api.contrib.DiLoCoOptimizer` over the Trainer's
  optimizer synchronizes the weights every ``sync_every`` optimizer steps (``on_optimizer_step``, which the Trainer
  calls after every step, including one its GradScaler skipped, so the ranks keep one schedule). The ranks hold the
  same weights right after each synchronization (with ``fragments=1`` and ``overlap_steps=0``).

Gradient accumulation works as usual: the Trainer runs its micro-batches under ``no_sync()``, where DDP calls no
hook. A callback is not handed the DDP model, so it takes the Trainer (as TRL's callbacks do).

Checkpoints: the Trainer saves rank 0's model and optimizer only. With DiLoCo, save at synchronization steps
(``save_steps`` a multiple of ``sync_every``), where every rank holds the same weights; on resume the outer
optimizer's state (its momentum) starts afresh from the loaded weights.

Example:
    >>> trainer = Trainer(model=model, args=args, train_dataset=dataset)  # doctest: +SKIP
    >>> trainer.add_callback(BaguaCallback("bytegrad", trainer=trainer))  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("bagua.integrations.hf needs transformers: pip install 'bagua[hf]'") from exc

from bagua.torch_api.algorithms.checks import check_choice
from bagua.torch_api.contrib.ddp_hooks import ByteGradState, LocalState, bytegrad_hook, local_hook
from bagua.torch_api.contrib.diloco_optimizer import DiLoCoOptimizer

__all__ = ["ALGORITHMS", "BaguaCallback"]

logger = logging.getLogger(__name__)

#: what :class:`BaguaCallback` can run, and the class whose keyword arguments each takes
ALGORITHMS = {"bytegrad": ByteGradState, "diloco": DiLoCoOptimizer}


def _accepted(algorithm: str) -> list[str]:
    skip = {"self", "inner_optimizer"}
    return [name for name in inspect.signature(ALGORITHMS[algorithm].__init__).parameters if name not in skip]


class BaguaCallback(TrainerCallback):
    """Train under a ``transformers.Trainer`` with Bagua's ByteGrad or DiLoCo.

    Args:
        algorithm: ``"bytegrad"`` or ``"diloco"``.
        trainer: the ``Trainer`` (its DDP model is registered on when training begins); may also be set later as
            ``callback.trainer``, before ``train()``.
        **options: keyword arguments of :class:`~bagua.torch_api.contrib.ddp_hooks.ByteGradState`
            (``error_feedback``, ``codec``) or of :class:`~bagua.torch_api.contrib.DiLoCoOptimizer`
            (``sync_every``, ``outer_lr``, ``fragments``, ``warmup_steps``, ...).

    Attributes: ``state`` (the :class:`ByteGradState`, with its stats) or ``diloco`` (the
    :class:`DiLoCoOptimizer`), once training has begun.

    Example:
        >>> callback = BaguaCallback("diloco", trainer=trainer, sync_every=50)  # doctest: +SKIP
        >>> trainer.add_callback(callback)  # doctest: +SKIP
    """

    def __init__(self, algorithm: str = "bytegrad", trainer: Any = None, **options: Any) -> None:
        check_choice("BaguaCallback", "algorithm", algorithm, tuple(ALGORITHMS))
        unknown = sorted(set(options) - set(_accepted(algorithm)))
        if unknown:
            raise ValueError(f"BaguaCallback(algorithm={algorithm!r}) got unknown keyword arguments {unknown}; "
                             f"{ALGORITHMS[algorithm].__name__} accepts {_accepted(algorithm)}")
        self.algorithm = algorithm
        self.trainer = trainer
        self.options = options
        self.state: Optional[ByteGradState] = None
        self.diloco: Optional[DiLoCoOptimizer] = None
        self._hooked: Optional[weakref.ref] = None  # the DDP model that holds the hook

    # -- the Trainer's events ----------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        ddp = self._ddp_model()
        if ddp is None or (self._hooked is not None and self._hooked() is ddp):
            return  # one process, or a second train() on the same DDP model, which keeps its hook
        if self.algorithm == "bytegrad":
            self.state = ByteGradState(**self.options)
            ddp.register_comm_hook(self.state, bytegrad_hook)
        else:
            ddp.register_comm_hook(LocalState(self.options.get("warmup_steps", 0)), local_hook)
            inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps torch's
            self.diloco = DiLoCoOptimizer(inner, **self.options)
            if state.global_step > 0:
                logger.warning("BaguaCallback: resuming DiLoCo at step %d; the outer optimizer's state starts afresh "
                               "from the loaded weights", state.global_step)
        self._hooked = weakref.ref(ddp)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.diloco is not None:
            self.diloco.after_inner_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for owner in (self.state, self.diloco):
            if owner is not None:
                owner.close()  # its thread stops; a later train() starts another

    # -- finding DDP -------------------------------------------------------------------------------------------

    def _ddp_model(self) -> Optional[torch.nn.parallel.DistributedDataParallel]:
        if self.trainer is None:
            raise ValueError("BaguaCallback needs the Trainer, whose DDP model it registers on: "
                             "trainer.add_callback(BaguaCallback(..., trainer=trainer))")
        model = self.trainer.model_wrapped
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        if not dist.is_initialized() or dist.get_world_size() == 1:
            logger.warning("BaguaCallback: a single process, so nothing to communicate; training runs as it is")
            return None
        raise ValueError(f"BaguaCallback works with torch DDP, the Trainer's wrapping for several processes; this "
                         f"Trainer wrapped the model in {type(model).__name__} (FSDP or DeepSpeed?). Train without "
                         "them, or use bagua's own wrapper (model.with_bagua)")
