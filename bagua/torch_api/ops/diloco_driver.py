"""DiLoCo's outer loop, written once: the driver behind ``DiLoCoAlgorithm`` and ``contrib.DiLoCoOptimizer``.

:class:`DiLoCoDriver` owns what the two share: the fragments (:class:`~bagua.torch_api.ops.diloco.Fragment`) and
their outer optimizers, the communicator the pseudo-gradients are averaged on, how an exchange is run (inline, on a
thread of the driver's own, or on the engine's communication thread), the step counters, the codec workspace
factory and the checkpoint of it all. Its callers only map their own events to its moments:

- :meth:`DiLoCoDriver.build` once the inner phases start (after the warm-up), over the parameters in order;
- :meth:`DiLoCoDriver.count_step` at the end of each inner step (taken or skipped by ``GradScaler``);
- :meth:`DiLoCoDriver.end_steps` once the optimizer has stepped (finish the exchanges due, start the ones due);
- :meth:`DiLoCoDriver.state_dict` / :meth:`DiLoCoDriver.load_state_dict` and :meth:`DiLoCoDriver.close`;
- with fault tolerance, :meth:`DiLoCoDriver.join` once the fragments are built. Each exchange is then a round of the
  :class:`~bagua.torch_api.fault.replica.FaultTolerance` communicator (:meth:`DiLoCoDriver._fault_round`: start the
  round, average over its members, commit on its verdict), which heals a joiner through the driver's
  :meth:`DiLoCoDriver.heal_state_dict` / :meth:`DiLoCoDriver.load_heal_state_dict`: the fault layer never reads
  the driver.

The fault-tolerant rounds live in :class:`~bagua.torch_api.ops.diloco_fault_rounds.FaultRounds`, the reports,
plans and records of rounds by time and the link rule (:class:`~bagua.torch_api.ops.diloco_pace.Pace`) in
:class:`~bagua.torch_api.ops.diloco_report.PacedRounds`: both are base classes of the driver.

Both exchanges run one path, :meth:`~bagua.torch_api.ops.diloco.Fragment.exchange`, over the ranks
(:class:`~bagua.torch_api.ops.diloco_exchange.OverRanks`) or over a round's members
(:class:`~bagua.torch_api.ops.diloco_exchange.OverMembers`); either keeps its residuals in the fragment's
``workspace``, which the checkpoint saves.

:class:`~bagua.torch_api.algorithms.diloco.DiLoCoAlgorithmImpl` maps the Bagua engine's hooks to these moments,
:class:`~bagua.torch_api.contrib.diloco_optimizer.DiLoCoOptimizer` its ``step()``; with the same hyper-parameters
(and a flat exchange) both therefore give the same weights, bit for bit.

Example:
    >>> driver = DiLoCoDriver(DiLoCoAlgorithm(sync_every=2), "DiLoCo", communicator=c)  # doctest: +SKIP
    >>> driver.build(list(model.parameters()))  # doctest: +SKIP
    >>> driver.count_step(warm=False); driver.end_steps()  # after each optimizer step  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional, Sequence

import torch

from bagua.torch_api import env
from bagua.torch_api.comm import hierarchy
from bagua.torch_api.comm.process_group import BaguaCommunicator, BaguaProcessGroup
from bagua.torch_api.codecs.workspace import make_workspace
from bagua.torch_api.fault.replica import FaultTolerance
from bagua.torch_api.ops.diloco import Fragment, due_fragments, split_fragments, sync_offsets
from bagua.torch_api.ops.diloco_async import AsyncDiLoCo
from bagua.torch_api.ops.diloco_async_ft import AsyncFaultTolerant
from bagua.torch_api.ops.diloco_exchange import MemberResiduals, OverRanks
from bagua.torch_api.ops.diloco_fault_rounds import FaultRounds
from bagua.torch_api.ops.diloco_outer import resolve_outer
from bagua.torch_api.ops.diloco_pace import Pace
from bagua.torch_api.ops.diloco_report import PacedRounds
from bagua.torch_api.ops.diloco_stats import Rounds

__all__ = ["DiLoCoDriver", "Submit", "driver_property"]

#: runs ``fn`` off the main thread: ``submit(fn, what, cuda) -> job`` with ``job.wait(timeout_s)``
Submit = Callable[[Callable[[], None], str, bool], Any]


class DiLoCoDriver(FaultRounds, PacedRounds):
    """Fragments, their exchanges and outer steps, the step counters and their checkpoint.

    Args:
        hyper: the hyper-parameters, a :class:`~bagua.torch_api.algorithms.diloco.DiLoCoAlgorithm`.
        owner: names the caller in errors (``"DiLoCo"``, ``"DiLoCoOptimizer"``).
        communicator: average on this communicator, every rank calling the exchange.
        group, hierarchical: or on this group, through
            :func:`~bagua.torch_api.comm.hierarchy.run_hierarchically` (``communicator`` must then be ``None``).
        worker: a :class:`~bagua.torch_api.comm.worker.CommWorker` of the driver's own that runs the
            exchanges (stopped by :meth:`close`); without it they run inline, unless :attr:`submit` is set.

    Attributes: ``fragments``, ``steps`` (inner steps counted, warm-up included), ``processed`` (steps whose
    end-of-step work is done), ``syncs`` (outer steps taken), ``bytes_sent``, ``error_feedback``, ``submit``,
    ``pace`` (a :class:`~bagua.torch_api.ops.diloco_pace.Pace`: rounds by time, the link rule), ``records`` (with
    either, one :class:`~bagua.torch_api.ops.diloco_stats.RoundRecord` per round ended).
    """

    def __init__(self, hyper: Any, owner: str, communicator: Optional[BaguaCommunicator] = None,
                 group: Optional[BaguaProcessGroup] = None, hierarchical: bool = False,
                 worker: Optional[Any] = None, fault: Optional[FaultTolerance] = None) -> None:
        # user hyper-parameters, "auto" outer settings resolved for the workers that average
        #: the replicas that average (the job's workers with fault tolerance): what "auto" outer settings use
        self.workers = (fault.workers if fault is not None else communicator.nranks()
                        if communicator is not None else len(group.ranks) if group is not None else 1)
        self.hyper = resolve_outer(hyper, self.workers)
        self.owner = owner
        self.error_feedback = hyper.compression != "none" if hyper.error_feedback is None else hyper.error_feedback
        # where and how the exchanges run
        self.communicator = communicator
        self.group = group
        self.hierarchical = hierarchical
        self.worker = worker
        #: a :class:`~bagua.torch_api.fault.replica.FaultTolerance`: each exchange over the round's live workers
        self.fault = fault
        #: how an exchange leaves the main thread (the engine's ``submit_job`` for the algorithm); None: inline
        self.submit: Optional[Submit] = self._on_worker if worker is not None else None
        # internal state
        self.fragments: list[Fragment] = []
        self.steps = 0
        self.processed = 0
        self._offsets = sync_offsets(hyper.sync_every, hyper.fragments)
        self._loaded: Optional[dict[str, torch.Tensor]] = None  # a checkpoint waiting for the fragments
        #: asynchronous DiLoCo (``asynchronous=True``): each pseudo-gradient applied on arrival, by a server
        self.asynchronous = AsyncDiLoCo(self.hyper, (group if communicator is None else communicator).ranks,
                                        owner) if getattr(hyper, "asynchronous", False) and fault is None else None
        if getattr(hyper, "asynchronous", False) and fault is not None:  # ordered by the coordinator's store
            if fault.ranks is not None:
                raise ValueError(f"{owner}(asynchronous=True, fault_tolerance=...) runs one process per worker, not "
                                 "sharded workers (FSDP2) yet; use asynchronous=False there")
            self.asynchronous = AsyncFaultTolerant(self.hyper, fault, owner)
        #: rounds by time and the link rule (inactive by default: today's schedule)
        self.pace = Pace(hyper)
        # stats
        self.syncs = 0
        self.bytes_sent = 0
        self.stats = Rounds(self._publisher())

    # -- the moments of a step ---------------------------------------------------------------------------------

    def build(self, params: list[torch.Tensor], units: Optional[Sequence[int]] = None,
              unit_bytes: Optional[Sequence[int]] = None) -> None:
        """Split ``params`` (model order, none empty) into fragments whose global weights are their values now,
        then load the checkpoint that waited for them, if any.

        ``units``: the number of consecutive parameters of each unit, which a fragment never cuts (the FSDP2 units
        of a sharded replica), and ``unit_bytes`` their sizes to split by (default: of ``params``); ``None``: every
        parameter is a unit.
        """
        hyper = self.hyper
        if units is not None and self.pace.active and self.fault is not None:  # only sharded replicas pass units
            raise ValueError(f"{self.owner}: rounds=\"time\" and sync_every_max do not run on fault-tolerant "
                             "sharded workers (FSDP2) yet: each shard's round would measure and plan on its own, and "
                             "shards of one worker must take the same inner steps. Use rounds=\"steps\" and "
                             "sync_every_max=None there, or run the replicas without fault_tolerance")
        counts = list(units) if units is not None else [1] * len(params)
        if sum(counts) != len(params):
            raise ValueError(f"units={counts} cover {sum(counts)} parameters, not the {len(params)} given")
        starts = [sum(counts[:u]) for u in range(len(counts))]
        sizes = list(unit_bytes) if unit_bytes is not None else [
            sum(p.numel() * p.element_size() for p in params[a : a + n]) for a, n in zip(starts, counts)]
        parts = [[i for u in part for i in range(starts[u], starts[u] + counts[u])]
                 for part in split_fragments(sizes, hyper.fragments, hyper.fragment_layout)]
        if not all(parts):
            raise ValueError(f"{self.owner}: with fragments={hyper.fragments}, a fragment holds no element on this "
                             "rank (its shards of those units are empty); use fewer fragments")
        outer = self.outer_factory()
        self.fragments = [Fragment(i, [params[k] for k in part], outer, hyper.offload_outer_state)
                          for i, part in enumerate(parts)]
        if self._loaded is not None:
            self._load_fragments(self._loaded)
        if self.asynchronous is not None:
            self.asynchronous.start(self.fragments[0])

    def outer_factory(self) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
        """Return what builds a fragment's outer optimizer over ``[global]``: the user's ``outer_optimizer``, or SGD
        with the ``outer_lr``, ``outer_momentum`` and ``nesterov`` settings."""
        hyper = self.hyper
        return hyper.outer_optimizer or functools.partial(
            torch.optim.SGD, lr=hyper.outer_lr, momentum=hyper.outer_momentum,
            nesterov=hyper.nesterov and hyper.outer_momentum > 0,
        )

    @property
    def warming_up(self) -> bool:
        """Whether the steps counted are still the warm-up's (``warmup_steps`` of plain gradient averaging)."""
        return self.steps < self.hyper.warmup_steps

    def begin(self, params: list[torch.Tensor], optimizer: Optional[torch.optim.Optimizer] = None,
              units: Optional[Sequence[int]] = None, unit_bytes: Optional[Sequence[int]] = None) -> None:
        """Start the inner phases: :meth:`build` the fragments over ``params`` (their values now are the global
        weights), then, with fault tolerance, :meth:`join` the job (``optimizer``: the inner one, which heals
        too)."""
        self.build(params, units, unit_bytes)
        if isinstance(self.asynchronous, AsyncFaultTolerant):  # joined in build(): resume its own rounds' steps
            self.steps = self.processed = self.asynchronous.resume_steps
        elif self.fault is not None:  # the first worker's weights, or a live peer's state
            self.join(optimizer)

    def after_steps(self, begin: Callable[[], None]) -> None:
        """The end-of-step work of the steps counted: the first time the warm-up is over, ``begin()`` (the caller's
        :meth:`begin` over its parameters); then :meth:`end_steps`."""
        if not self.warming_up and not self.fragments:
            begin()  # the inner phases start from the weights the warm-up reached
        self.end_steps()

    def count_step(self, warm: Optional[bool] = None) -> None:
        """Count one inner step; a warm-up step (``warm``, default :attr:`warming_up`) has no end-of-step work, so
        it counts as processed."""
        warm = self.warming_up if warm is None else warm
        self.steps += 1
        if warm:
            self.processed = self.steps
            return
        self.pace.count_step()
        if self.fault is not None:
            self.fault.count_step(len(self.fragments))

    def end_steps(self) -> None:
        """Do the end-of-step work of every inner step counted and not yet processed: finish the exchanges due,
        start the ones due (in fragment order, the same on every rank)."""
        H, tau, pace = self.hyper.sync_every, self.hyper.overlap_steps, self.pace
        if not pace.active or self.processed == self.steps:
            self._end_steps(H, tau)
            return
        pace.computed(self.steps - self.processed)  # the steps' compute: since the last end-of-step work
        try:
            self._end_steps(H, tau)
        finally:
            pace.mark()

    def _end_steps(self, H: int, tau: int) -> None:
        pace = self.pace
        while self.processed < self.steps:
            self.processed += 1
            step = self.processed - self.hyper.warmup_steps
            for fragment in self.fragments:
                if fragment.pending is not None and fragment.pending[0] <= step:
                    self._finish(fragment)
            for p in pace.due(step) if pace.active else due_fragments(step, H, self._offsets):
                if self.asynchronous is not None:  # applied when it arrives; go on from the newest weights
                    self.asynchronous.exchange(self.fragments[p], self.pace.take_samples(p))
                    self.syncs += 1
                    continue
                if not self._start(self.fragments[p], step + tau):
                    return  # left out of the round: healed from a peer, whose counters this rank now holds
                if tau == 0:
                    self._finish(self.fragments[p])
            if pace.active and pace.round_over(step):
                pace.new_round(step)

    # -- fragments and their exchanges -------------------------------------------------------------------------

    def _on_worker(self, fn: Callable[[], None], what: str, cuda: bool) -> Any:
        # deferred: the data-parallel package imports the algorithms, which import this module
        from bagua.torch_api.comm.worker import CommJob

        return CommJob(self.worker, fn, what, cuda=cuda)

    def _start(self, fragment: Fragment, finish_step: int) -> bool:
        delta = fragment.pseudo_gradient()
        if self.pace.active:
            self.pace.started_in[fragment.index] = self.pace.round
        if getattr(self.hyper, "eager", False):  # the local stand-in, before the exchange averages delta in place
            self._warm_outer_lr(fragment, finish_step - self.hyper.overlap_steps)
            fragment.eager_step()
        elif getattr(self.hyper, "overlap_keep", False):  # x_sent, before the inner steps move the weights on
            fragment.keep_step()
        if self.fault is not None:  # inline, over the round's live workers
            if not self._fault_round(fragment):
                return False
            fragment.pending = (finish_step, None)
            return True
        if self.pace.active:
            self._report(fragment, delta)
        job = None
        if self.submit is not None:
            job = self.submit(lambda: self._exchange(fragment, delta), f"DiLoCo exchange of fragment {fragment.index}",
                              delta.is_cuda)
        else:
            self._exchange(fragment, delta)
        fragment.pending = (finish_step, job)
        return True

    def _exchange(self, fragment: Fragment, delta: torch.Tensor) -> None:
        """Average ``delta`` (the fragment's) over the ranks, in place (on the thread :attr:`submit` chose)."""

        def exchange(t: torch.Tensor, c: BaguaCommunicator) -> None:
            self.bytes_sent += fragment.exchange(OverRanks(c), self.hyper.compression, self.hyper.block_size,
                                                 self.error_feedback)

        started = time.monotonic()
        if self.group is None:
            exchange(delta, self.communicator)  # type: ignore[arg-type]
        else:
            hierarchy.run_hierarchically(self.group, self.hierarchical, delta, exchange, average=True)
        self.pace.exchange_s += time.monotonic() - started

    def _finish(self, fragment: Fragment) -> None:
        self._warm_outer_lr(fragment)
        # eager updates and overlap_keep both move the weights by g - (what _start kept in fragment.eager)
        corrected = getattr(self.hyper, "eager", False) or getattr(self.hyper, "overlap_keep", False)
        fragment.finish(env.get_comm_timeout_s(), self.hyper.overlap_alpha if self.hyper.overlap_steps > 0 else 0.0,
                        self.owner, eager=corrected)
        self.syncs += 1

    def _warm_outer_lr(self, fragment: Fragment, started: Optional[int] = None) -> None:
        """With ``outer_lr_warmup=W`` and the default outer SGD: the fragment's ``k``-th outer step (from 0) takes
        ``outer_lr * min(1, (k + 1) / W)``. ``k`` comes from the step its exchange started at (the fragment starts
        at its offset, then every ``sync_every`` steps), which checkpoints and heals restore, so a resumed run
        ramps as an uninterrupted one. ``started``: that step, before the exchange is pending (an eager step)."""
        warmup = getattr(self.hyper, "outer_lr_warmup", 0)
        if warmup and self.hyper.outer_optimizer is None:
            if started is None:
                started = fragment.pending[0] - self.hyper.overlap_steps
            k = (started - self._offsets[fragment.index]) // self.hyper.sync_every
            if self.pace.active:  # rounds of changing length: the round the exchange started in
                k = self.pace.started_in.get(fragment.index, self.pace.round)
            for group in fragment.outer.param_groups:
                group["lr"] = self.hyper.outer_lr * min(1.0, (k + 1) / warmup)

    def finish_now(self, fragment: Fragment) -> None:
        """Take the outer step of ``fragment`` with the average in its ``delta`` (a worker that healed in a round
        of fault-tolerant DiLoCo)."""
        fragment.pending = (self.processed, None)
        self._finish(fragment)

    def _check_built(self) -> None:
        if not self.fragments:
            raise ValueError(f"{self.owner}: the fragments are not built yet (still warming up, or before the first "
                             "step): heal after the warm-up, at a synchronization")

    def _make_workspace(self, fragment: Fragment) -> object:
        if self.fault is not None:
            return MemberResiduals()
        c = self.communicator if self.group is None else hierarchy.exchange_communicator(self.group,
                                                                                          self.hierarchical)
        return make_workspace(self.hyper.compression, fragment.numel, c.nranks(), block_size=self.hyper.block_size)

    # -- checkpoints and teardown ------------------------------------------------------------------------------

    def state_dict(self, counters: Sequence[str] = ("steps", "processed")) -> dict[str, torch.Tensor]:
        """The ``counters`` named (``"steps"``, ``"processed"``), then each fragment's global weights,
        outer-optimizer tensors, residuals and an exchange in flight (waited for)."""
        if self.asynchronous is not None:  # refused mid-run: no consistent cut of an asynchronous run (yet)
            self.asynchronous.check_checkpoint()
        state = {name: torch.tensor(getattr(self, name)) for name in counters}
        state.update(self.pace.state_dict())  # the round's position (rounds by time, the link rule)
        for fragment in self.fragments:
            state.update(fragment.state_dict(env.get_comm_timeout_s()))
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned; before :meth:`build`, the fragments' part waits for it."""
        self.steps = int(state["steps"])
        # without "processed" (the optimizer's format) every step counted was processed
        self.processed = int(state["processed"]) if "processed" in state else self.steps
        self.pace.load_state_dict(state)
        if not self.fragments:
            self._loaded = state if any(k.endswith(".global") for k in state) else None
            return
        self._load_fragments(state)

    def _load_fragments(self, state: dict[str, torch.Tensor]) -> None:
        self._loaded = None
        for fragment in self.fragments:
            fragment.load_state_dict(state, functools.partial(self._make_workspace, fragment))

    def wait_pending(self, strict: bool = True) -> None:
        """Wait for every exchange in flight (its result stays for its outer step); ``strict=False`` ignores a
        failed one (the engine is being torn down: its error was or will be raised by another wait)."""
        for fragment in self.fragments:
            if fragment.pending is not None and fragment.pending[1] is not None:
                try:
                    fragment.pending[1].wait(env.get_comm_timeout_s())
                except RuntimeError:
                    if strict:
                        raise
                    continue
                fragment.pending = (fragment.pending[0], None)

    def close(self, strict: bool = True) -> None:
        """Wait for the exchanges in flight (see :meth:`wait_pending`), then stop the driver's own thread."""
        self.wait_pending(strict)
        if self.asynchronous is not None and self.fragments:
            self.asynchronous.finish(self.fragments[0])  # every rank ends with the final global weights
        if self.worker is not None:
            self.worker.close()
            self.worker = None
            self.submit = None

    def release_for_exit(self) -> None:
        """At interpreter exit: stop the thread without waiting long and drop the communicator (its group is then
        freed while the interpreter is whole)."""
        if self.worker is not None:
            self.worker.close(join_timeout_s=1.0)
            self.worker = None
            self.submit = None
        self.communicator = None


def driver_property(name: str, doc: str) -> property:
    """Make a read-only property that reads ``name`` from the owner's ``driver`` (a :class:`DiLoCoDriver`), so
    the algorithm and the optimizer keep the attributes (``steps``, ``syncs``, ...) they always had."""
    return property(lambda owner: getattr(owner.driver, name), doc=doc)
