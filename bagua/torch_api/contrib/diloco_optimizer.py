"""DiLoCo for plain DDP: an optimizer wrapper, designed after torch's ``PostLocalSGDOptimizer`` / ``ModelAverager``.

The maths of :class:`~bagua.torch_api.algorithms.diloco.DiLoCoAlgorithm` (DiLoCo, https://arxiv.org/abs/2311.08105;
Streaming DiLoCo, https://arxiv.org/abs/2501.18512), run by the same driver
(:class:`~bagua.torch_api.ops.diloco_driver.DiLoCoDriver`, whose moments its :meth:`~DiLoCoOptimizer.step` calls),
for people who keep torch DDP, Accelerate or a Hugging Face ``Trainer``:

1. inner steps: every rank steps its own optimizer (the *inner* one) on its own gradients. DDP must not average
   them: register :func:`bagua.torch_api.contrib.ddp_hooks.local_hook` on the DDP model, or run the backward
   passes under ``no_sync()``;
2. after every ``H``-th step (``sync_every``; with ``F`` fragments, each fragment at its own evenly spaced step of
   every round), the fragment's pseudo-gradient ``delta = g - x`` (``g``: its global weights, float32, the same on
   every rank; ``x``: this rank's weights) is averaged over the ranks on a process group of the optimizer's own;
3. the outer optimizer (SGD; ``outer_lr="auto"`` by default: lr 1 without momentum at 2-8 workers or H < 100) steps ``g`` with that average, and the
   weights become ``x = g`` (or, when the exchange overlapped ``tau`` inner steps, ``x = alpha * x + (1 - alpha) * g``).

Steps are counted at every call of :meth:`DiLoCoOptimizer.step`, including those that ``torch.amp.GradScaler``
skips: the optimizer declares ``_step_supports_amp_scaling``, so ``scaler.step(optimizer)`` always calls it and
hands it ``found_inf`` and ``grad_scale``; a rank whose gradients overflowed skips its inner step but keeps the
synchronization schedule of the others. The weights start as rank 0's (broadcast when the fragments are built).

With the same hyper-parameters, model, data and inner optimizer, it gives the weights of ``with_bagua`` and
``DiLoCoAlgorithm(hierarchical=False)``, bit for bit (tests/contrib/test_diloco_optimizer.py).

Example:
    >>> ddp = torch.nn.parallel.DistributedDataParallel(model)  # doctest: +SKIP
    >>> ddp.register_comm_hook(None, ddp_hooks.local_hook)  # doctest: +SKIP
    >>> optimizer = DiLoCoOptimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-3), sync_every=50)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch
import torch.distributed as dist

from bagua.torch_api.algorithms.diloco import DiLoCoSettings, check_fault_tolerant_settings
from bagua.torch_api.comm.own_group import group_ranks, own_communicator, release_at_exit
from bagua.torch_api.comm.worker import CommWorker
from bagua.torch_api.fault.replica import FaultTolerance
from bagua.torch_api.ops.diloco_driver import DiLoCoDriver, driver_property

__all__ = ["DiLoCoOptimizer"]


@dataclass
class _OptimizerSettings(DiLoCoSettings):
    """DiLoCo's settings, checked once (by :class:`DiLoCoSettings`), errors naming this class."""

    owner: ClassVar[str] = "DiLoCoOptimizer"


#: the settings this optimizer takes: DiLoCo's, but ``hierarchical`` (it averages over its group, flat)
SETTINGS = tuple(f.name for f in dataclasses.fields(DiLoCoSettings) if f.name != "hierarchical")


def _settings(sync_every: int, settings: dict[str, Any]) -> DiLoCoSettings:
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TypeError(f"DiLoCoOptimizer got unknown setting(s) {unknown}; it takes {', '.join(SETTINGS)}, "
                        "process_group and fault_tolerance")
    return _OptimizerSettings(sync_every=sync_every, hierarchical=False, **settings)


def _check_fault_tolerance(hyper: DiLoCoSettings, process_group: Any) -> None:
    """Refuse, before anything is built, what fault-tolerant DiLoCo does not run (yet), saying why."""
    check_fault_tolerant_settings(hyper, "DiLoCoOptimizer")
    if process_group is not None:
        raise ValueError(f"DiLoCoOptimizer(fault_tolerance=...) needs process_group=None, got {process_group!r}: "
                         "the workers share no torch world; each is one process")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("DiLoCoOptimizer(fault_tolerance=...): each worker is one process (a job of its own); this "
                         f"process is in a torch world of {dist.get_world_size()} ranks. Start one process per worker")


class DiLoCoOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer so that every ``sync_every`` of its steps end with DiLoCo's outer step.

    Building it is collective (it creates a process group of its own and broadcasts rank 0's weights): every rank
    builds it, in the same order relative to other groups.

    Args:
        inner_optimizer: the optimizer of the inner steps (e.g. ``AdamW``), over the parameters of the model.
        sync_every, settings: DiLoCo's settings, the keywords of
            :class:`~bagua.torch_api.algorithms.diloco.DiLoCoSettings` but ``hierarchical`` (checked there; each
            means what it means for :class:`~bagua.torch_api.algorithms.diloco.DiLoCoAlgorithm`). Here fragments
            take the parameters in the inner optimizer's order, ``overlap_steps`` runs an exchange on a thread of
            the optimizer's own, and the ``warmup_steps``' gradients are DDP's to average: register ``local_hook``
            with ``LocalState(warmup_steps=...)`` of the same value.
        process_group: the ranks to synchronize (``None``: the default group; a torch ``ProcessGroup`` or a
            ``BaguaProcessGroup``).
        fault_tolerance: a :class:`~bagua.torch_api.fault.replica.FaultTolerance`: this process is one worker
            of a job whose workers fail alone; each synchronization runs over the live workers, and building the
            optimizer joins the job (the first worker's weights at the start, a live peer's state later).

    Attributes: ``inner`` (the wrapped optimizer), ``steps`` (steps counted), ``syncs`` (outer steps taken),
    ``bytes_sent``.

    Example:
        >>> inner = torch.optim.AdamW(ddp.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> optimizer = DiLoCoOptimizer(inner, sync_every=100, fragments=4)  # doctest: +SKIP
        >>> scaler.step(optimizer)  # or optimizer.step()  # doctest: +SKIP
    """

    #: GradScaler.step calls step() even when it found Inf/NaN, passing found_inf/grad_scale: skipped inner steps
    #: are still counted, so the ranks keep one synchronization schedule
    _step_supports_amp_scaling = True

    def __init__(self, inner_optimizer: torch.optim.Optimizer, sync_every: int = 10, *, process_group: Any = None,
                 fault_tolerance: Optional[FaultTolerance] = None, **settings: Any) -> None:
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise ValueError(f"DiLoCoOptimizer(inner_optimizer=...) must be a torch.optim.Optimizer, e.g. "
                             f"torch.optim.AdamW(model.parameters()); got {type(inner_optimizer).__name__}")
        # user hyper-parameters
        self.inner = inner_optimizer
        self.hyper = _settings(sync_every, settings)
        # internal state: the driver (DiLoCo's run, shared with DiLoCoAlgorithm) on a group of its own
        if fault_tolerance is not None:
            _check_fault_tolerance(self.hyper, process_group)
            self.ranks = [0]
            self.driver = DiLoCoDriver(self.hyper, "DiLoCoOptimizer", fault=fault_tolerance)
        else:
            self.ranks = group_ranks(process_group, "DiLoCoOptimizer")
            worker = CommWorker("bagua-diloco-optimizer", None) if self.hyper.overlap_steps > 0 else None
            self.driver = DiLoCoDriver(self.hyper, "DiLoCoOptimizer", communicator=own_communicator(self.ranks),
                                       worker=worker)
            release_at_exit(self)
        self.hyper = self.driver.hyper  # "auto" outer settings resolved for the workers
        if not self.driver.warming_up:
            self._build_fragments()

    # the driver's state, under the names this class always had
    error_feedback = driver_property("error_feedback", "whether each rank's compression error is carried")
    steps = driver_property("steps", "steps counted (taken or skipped, warm-up included)")
    fragments = driver_property("fragments", "the fragments, built when the warm-up ends")
    syncs = driver_property("syncs", "outer steps taken")
    bytes_sent = driver_property("bytes_sent", "bytes this rank sent in exchanges")

    # -- the optimizer interface, delegated to the inner optimizer ---------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError("DiLoCoOptimizer: add the parameter group to the inner optimizer before wrapping it (the "
                         "fragments' global weights are built over the parameters it holds then)")

    def __repr__(self) -> str:
        return f"DiLoCoOptimizer({self.inner!r}, sync_every={self.hyper.sync_every}, fragments={len(self.fragments)})"

    # -- one step ------------------------------------------------------------------------------------------------

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Run the inner step (unless GradScaler found Inf/NaN), then :meth:`after_inner_step`."""
        found_inf = getattr(self, "found_inf", None)  # both set by GradScaler.step (_step_supports_amp_scaling)
        grad_scale = getattr(self, "grad_scale", None)
        loss = None
        if found_inf is None or not bool(found_inf):
            if grad_scale is not None:
                self._unscale(grad_scale)
            loss = self.inner.step() if closure is None else self.inner.step(closure)
        self.after_inner_step()
        return loss

    @torch.no_grad()
    def _unscale(self, grad_scale: torch.Tensor) -> None:
        # as GradScaler.unscale_: one multiplication by the float32 of the float64 reciprocal
        inv = grad_scale.double().reciprocal().float()
        for group in self.inner.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(inv.to(p.grad.device))

    def after_inner_step(self) -> None:
        """Count one inner step (taken or skipped) and run the synchronizations it makes due.

        :meth:`step` calls it; call it yourself after each step of the inner optimizer when a framework steps that
        optimizer (a Hugging Face ``TrainerCallback.on_optimizer_step``), on every rank, skipped steps included.
        """
        self.driver.count_step()
        self.driver.after_steps(self._build_fragments)  # once the warm-up is over: start the inner phases

    # -- fragments and their exchanges -------------------------------------------------------------------------

    def _parameters(self) -> list[torch.nn.Parameter]:
        seen: set[int] = set()
        params = []
        for group in self.inner.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        if not params:
            raise ValueError("DiLoCoOptimizer: the inner optimizer holds no trainable parameter")
        return params

    @torch.no_grad()
    def _build_fragments(self, broadcast: bool = True) -> None:
        params = self._parameters()
        c = self.driver.communicator  # None with fault tolerance: joining the job sets the weights
        if broadcast and c is not None and c.group is not None and c.nranks() > 1:
            for p in params:  # rank 0's weights everywhere, as with_bagua does
                dist.broadcast(p.data, c.global_rank(0), group=c.group)
        self.driver.begin(params, self.inner)

    # -- checkpoints and teardown ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus this rank's DiLoCo state under ``"diloco"`` (step counter, global
        weights, outer-optimizer tensors, residuals, an exchange in flight, waited for). Ranks differ between
        synchronizations: save every rank's."""
        state = self.inner.state_dict()
        state["diloco"] = self.driver.state_dict(("steps",))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (on the same rank)."""
        state = dict(state_dict)
        diloco = state.pop("diloco", None)
        self.inner.load_state_dict(state)
        if diloco is None:
            return
        self.driver.load_state_dict(diloco)  # before the fragments are built, it waits for them
        if not self.fragments and not self.driver.warming_up:
            self._build_fragments(broadcast=False)  # saved after the warm-up: the weights are each rank's own
        # else still warming up: the fragments are built when the warm-up ends

    def close(self) -> None:
        """Wait for an exchange in flight and stop the communication thread."""
        self.driver.close()

    def heal_state_dict(self) -> dict[str, torch.Tensor]:
        """What a joining worker takes from this one (see :meth:`DiLoCoDriver.heal_state_dict`)."""
        return self.driver.heal_state_dict()

    def load_heal_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take a peer's :meth:`heal_state_dict` (see :meth:`DiLoCoDriver.load_heal_state_dict`)."""
        self.driver.load_heal_state_dict(state)

    def _release_for_exit(self) -> None:
        self.driver.release_for_exit()  # the group is freed while the interpreter is whole
