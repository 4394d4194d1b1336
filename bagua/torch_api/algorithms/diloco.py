"""DiLoCo and Streaming DiLoCo: ``H`` local steps, then an outer optimizer step on the averaged weight change.

DiLoCo (Douillard et al. 2023, https://arxiv.org/abs/2311.08105): every rank runs ``sync_every`` (``H``) steps of
its own optimizer (the *inner* optimizer: the one passed to ``with_bagua``) on its own data, without any gradient
communication; then the ranks average the *pseudo-gradient* ``delta = g - x`` (``g``: the global weights of the
last synchronization, ``x``: the rank's weights now) and apply an *outer* optimizer (the paper's: SGD, lr 0.7,
Nesterov momentum 0.9; here by default ``outer_lr="auto"``, which picks it from the number of ranks and ``H``) to
``g``; every rank continues from the new ``g``. Communication falls by a factor ``H``.

Streaming DiLoCo (https://arxiv.org/abs/2501.18512) adds three things, each a knob here:

- ``fragments=F``: the parameters are split into ``F`` fragments of about equal bytes that synchronize in turn,
  evenly spaced within each round of ``H`` steps (the peak traffic falls by ``F``);
- ``overlap_steps=tau``: a fragment's exchange runs on the communication thread while ``tau`` more inner steps
  run; the outer step then lands on weights that moved on, and the two are merged as
  ``x = alpha * x + (1 - alpha) * g`` (``overlap_alpha``, the paper's alpha; with ``tau = 0`` simply ``x = g``);
- ``compression``: the pseudo-gradient travels as ``"bf16"``, in 8 or 4 bits per value with a min/max per block
  (``"uint8"``, ``"uint4"``), in 2 bits about each block's mean and RMS (``"nf2"``, best with ``block_size=256``;
  :mod:`bagua.torch_api.codecs.block`) or in 1 bit, each value's side of the mean (``"sign1"``), through a
  scatter-reduce-gather, or sparse (``"topk"``: each block's largest 1/32 with 4-bit values,
  :mod:`bagua.torch_api.codecs.sparse`) through an all-gather; accumulation and the outer step stay in float32, and
  error feedback (on by default when compressed) carries each rank's quantization error to its next pseudo-gradient.

Every rank ends each synchronization with the same global weights, bit for bit, whatever the compression (the
average is all-gathered as bytes); with ``tau = 0`` also the same model weights.

Steps are counted at the end of each backward that communicates (one per optimizer step; use ``no_sync()`` for
gradient accumulation), so a step that ``torch.amp.GradScaler`` skips still counts, the same on every rank. The
synchronization runs after the optimizer step (after every optimizer of the model has stepped), or, when a step
was skipped, before the next training forward.

Example:
    >>> from bagua.torch_api.algorithms.diloco import DiLoCoAlgorithm
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # doctest: +SKIP
    >>> model = model.with_bagua([optimizer], DiLoCoAlgorithm(sync_every=50))  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Union

import torch

from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms.diloco_checks import COMPRESSIONS, check_fault_tolerant_settings, check_settings
from bagua.torch_api.fault.replica import FaultTolerance
from bagua.torch_api.ops.diloco_driver import DiLoCoDriver, driver_property
from bagua.torch_api.ops.diloco_outer import AUTO
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.tensor import BaguaTensor

__all__ = ["DiLoCoSettings", "DiLoCoAlgorithm", "DiLoCoAlgorithmImpl", "COMPRESSIONS", "check_fault_tolerant_settings"]

class DiLoCoAlgorithmImpl(AlgorithmImpl):
    """DiLoCo bound to a group; see :class:`DiLoCoAlgorithm`. The engine's hooks drive a
    :class:`~bagua.torch_api.ops.diloco_driver.DiLoCoDriver` that runs the exchanges on the engine's thread."""

    def __init__(self, process_group: BaguaProcessGroup, algorithm: "DiLoCoAlgorithm") -> None:
        super().__init__(process_group)
        # user hyper-parameters
        self.hyper = algorithm
        self.hierarchical = algorithm.hierarchical is not False  # None: the engine's default, hierarchical
        # internal state
        self._stepped: set[int] = set()
        # with overlap an exchange runs while the main thread may communicate (find_unused_parameters): own groups
        fault = algorithm.fault_tolerance
        if fault is not None:  # one worker of a fault-tolerant job: its exchanges go over the round's live workers
            if len(process_group.ranks) != 1:
                raise ValueError("DiLoCoAlgorithm(fault_tolerance=...): each worker is one replica (a job of its "
                                 f"own); this model's group has {len(process_group.ranks)} ranks holding whole "
                                 "models. Start one process per worker, or shard the model over the worker's "
                                 "ranks with FSDP2 and pass with_bagua(..., device_mesh=mesh, replicate_dim=...) "
                                 "with a (1, shards) mesh")
            self.driver = DiLoCoDriver(algorithm, "DiLoCo", fault=fault)
        else:
            exchange_group = process_group.private_copy("diloco") if algorithm.overlap_steps > 0 else process_group
            self.driver = DiLoCoDriver(algorithm, "DiLoCo", group=exchange_group, hierarchical=self.hierarchical)
        self.hyper = self.driver.hyper  # "auto" outer settings resolved for this group's ranks
        self.warm = self.driver.warming_up

    # the driver's state, under the names this class always had
    error_feedback = driver_property("error_feedback", "whether each rank's compression error is carried")
    steps = driver_property("steps", "backward ends that communicate (inner steps, warm-up included)")
    processed = driver_property("processed", "steps whose end-of-step work is done")
    fragments = driver_property("fragments", "the fragments, built when the warm-up ends")
    syncs = driver_property("syncs", "outer steps taken")
    bytes_sent = driver_property("bytes_sent", "bytes this rank sent in exchanges")

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def need_reset(self) -> bool:
        return self.warm and self.steps >= self.hyper.warmup_steps

    def init_tensors(self, bagua_ddp) -> list[BaguaTensor]:
        self.warm = self.driver.warming_up
        if self.warm:
            return super().init_tensors(bagua_ddp)
        self.driver.submit = bagua_ddp.submit_job  # exchanges run on the engine's communication thread
        if not self.fragments:
            params = [p for _, p in bagua_ddp.bagua_build_params()]
            if not params:
                raise ValueError("DiLoCoAlgorithm: the model has no trainable parameter")
            if self.driver.fault is not None and len(bagua_ddp.bagua_optimizers) != 1:
                raise ValueError("DiLoCoAlgorithm(fault_tolerance=...) heals a joining worker with one inner "
                                 f"optimizer's state; this model has {len(bagua_ddp.bagua_optimizers)}")
            # equal on every rank: the engine broadcast them, the warm-up averaged
            self.driver.begin(params, bagua_ddp.bagua_optimizers[0] if self.driver.fault is not None else None)
        return []  # no gradient communication between synchronizations

    def init_operations(self, bagua_ddp, bucket) -> None:
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(hierarchical=self.hierarchical, average=True,
                                                 group=self.process_group)

    def init_forward_pre_hook(self, bagua_ddp) -> Callable[[Any], None]:
        def hook(inputs: Any) -> None:
            self._stepped.clear()
            if not self.warm:
                self.driver.end_steps()  # a step without optimizer step (GradScaler skipped it)

        return hook

    def init_backward_hook(self, bagua_ddp):
        if self.warm:
            return super().init_backward_hook(bagua_ddp)
        return lambda name, param: None

    def init_post_backward_hook(self, bagua_ddp) -> Callable[[], None]:
        def hook() -> None:
            if self.warm:
                bagua_ddp.launch_remaining_buckets()
                bagua_ddp.wait_pending_comm_ops()
            self.driver.count_step(self.warm)

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp) -> Callable[[torch.optim.Optimizer], None]:
        def hook(optimizer: torch.optim.Optimizer) -> None:
            self._stepped.add(id(optimizer))
            if not self.warm and all(id(o) in self._stepped for o in bagua_ddp.bagua_optimizers):
                self.driver.end_steps()

        return hook

    # -- checkpoints and teardown ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state: step counters, each fragment's global weights, outer-optimizer tensors, residuals,
        and the result of an exchange in flight (waited for). The ranks' weights differ between synchronizations,
        so every rank's checkpoint file is needed."""
        return self.driver.state_dict(("steps", "processed"))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.driver.load_state_dict(state)  # still warming up: the fragments load when they are built
        self.warm = self.driver.warming_up

    def close(self) -> None:
        self.driver.close(strict=False)  # the engine is being torn down; its error, if any, is raised elsewhere

    def heal_state_dict(self) -> dict[str, torch.Tensor]:
        """What a joining worker takes from this one (see :meth:`DiLoCoDriver.heal_state_dict`)."""
        return self.driver.heal_state_dict()

    def load_heal_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take a peer's :meth:`heal_state_dict` (see :meth:`DiLoCoDriver.load_heal_state_dict`)."""
        self.driver.load_heal_state_dict(state)


@dataclass
class DiLoCoSettings:
    """DiLoCo's hyper-parameters and their checks (:mod:`bagua.torch_api.algorithms.diloco_checks`), written once (see :class:`DiLoCoAlgorithm` for each one's
    meaning). :class:`DiLoCoAlgorithm` is these plus ``fault_tolerance``;
    :class:`~bagua.torch_api.contrib.diloco_optimizer.DiLoCoOptimizer` takes the same keywords (errors name the
    class the user called: its ``owner``). Picklable, no process state.

    Example:
        >>> DiLoCoSettings(sync_every=0)
        Traceback (most recent call last):
        ...
        ValueError: DiLoCoSettings(sync_every=...) must be an integer >= 1 (inner steps between synchronizations), got 0
    """

    #: names the class in error messages
    owner: ClassVar[str] = "DiLoCoSettings"

    sync_every: int = 10
    outer_lr: Union[float, str] = AUTO
    outer_momentum: Union[float, str] = AUTO
    nesterov: bool = True
    outer_optimizer: Optional[Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = None
    fragments: int = 1
    fragment_layout: str = "contiguous"
    overlap_steps: int = 0
    overlap_alpha: float = 0.5
    compression: str = "none"
    error_feedback: Optional[bool] = None
    block_size: int = 4096
    warmup_steps: int = 0
    hierarchical: Optional[bool] = None
    offload_outer_state: bool = False
    outer_lr_warmup: Union[int, str] = AUTO
    codec: Optional[str] = None
    asynchronous: bool = False
    rounds: str = "steps"
    speed_tolerance: float = 0.1
    sync_every_max: Optional[int] = None
    max_exchange_share: float = 0.1
    eager: bool = False
    overlap_keep: bool = False

    def __post_init__(self) -> None:
        check_settings(self)


@GlobalAlgorithmRegistry.register(
    "diloco", description="DiLoCo / Streaming DiLoCo: local steps, outer Nesterov step on the averaged weight change")
@dataclass
class DiLoCoAlgorithm(DiLoCoSettings, Algorithm):
    """Train ``sync_every`` steps locally, then average the weight change and take an outer optimizer step.

    Args:
        sync_every: inner steps between two synchronizations of a fragment (``H``; DiLoCo's papers use hundreds
            on large models; the default, 10, is what reached DDP's target on the measured GPT at 2 and 4 workers).
        outer_lr: learning rate of the default outer optimizer (SGD); ``"auto"`` (default): chosen from the number
            of ranks that average and ``sync_every`` by :func:`~bagua.torch_api.ops.diloco_outer.auto_outer` (up
            to ``H = 20``: 1.0 with Nesterov 0.5 warmed up over 10 outer steps, measured; the paper's 0.7 / 0.9
            from ``H = 100`` and 8 workers; plain averaging between).
        outer_momentum: its momentum (0 with ``outer_lr=1`` is plain periodic averaging: FedAvg, Accelerate's
            ``LocalSGD``, torch's post-local SGD); ``"auto"`` (default): as ``outer_lr``.
        nesterov: Nesterov momentum for the default outer optimizer.
        outer_optimizer: instead of SGD, a factory ``f(list_of_tensors) -> torch.optim.Optimizer`` (picklable, e.g.
            ``functools.partial(torch.optim.Adam, lr=1e-3)``); it steps float32 copies of the weights.
        fragments: Streaming DiLoCo's fragments (1: plain DiLoCo). At most ``sync_every``.
        fragment_layout: ``"contiguous"`` (runs of layers in model order) or ``"strided"`` (each fragment takes
            every ``F``-th run, spanning the model's depth).
        overlap_steps: ``tau``, inner steps run while a fragment's exchange travels (less than
            ``sync_every``); 0 waits for it at once.
        overlap_alpha: with ``overlap_steps > 0``, the weights become ``alpha * x + (1 - alpha) * g``.
        eager: with ``overlap_steps > 0``, eager updates (arXiv 2502.12996) instead of the merge: when a fragment's
            exchange starts, the weights take the outer step with this rank's own pseudo-gradient standing in for
            the average (``e``, on a copy of the outer state); when the average arrives, ``g`` takes the real
            outer step and the weights move by ``g - e``, keeping the inner steps made meanwhile
            (``overlap_alpha`` is then unused). Costs one more float32 copy of the weights. Default ``False``:
            measured on a small GPT at 4 and 8 workers it cost more steps than the merge
            (docs/log/2026-12-05-eager-updates.md).
        overlap_keep: with ``overlap_steps > 0``, instead of the merge: the weights take the outer step whole and
            keep the inner steps made while the average travelled, ``x = g + (x - x_sent)`` (``x_sent``: this
            rank's weights when the exchange started), so no inner step is lost and nothing stands in for the
            average; those steps then count in the fragment's next pseudo-gradient (``overlap_alpha`` is unused).
            Costs one more float32 copy of the weights. Default ``False``: with ``fragments=5, overlap_steps=1`` on
            the benchmark GPT at 4 hosts it cost more steps than dropping those steps (``overlap_alpha=0.0``)
            (docs/log/2026-12-05-overlap-remedy.md).
        compression: ``"none"`` (float32 allreduce), ``"bf16"``, ``"uint8"`` or ``"uint4"`` (block-wise min/max
            codes), ``"nf2"`` (2-bit codes about each block's mean and RMS; pass ``block_size=256``), ``"sign1"``
            (1 bit per value about each block's mean, scaled by its mean deviation; ``block_size=256``) or ``"topk"``
            (sparse: each block's largest 1/32 values, positions and 4-bit codes; ``block_size=256``): a name of
            :data:`~bagua.torch_api.codecs.registry.GlobalCodecRegistry`, or ``"none"``.
        error_feedback: keep each rank's compression error and add it to the next pseudo-gradient; ``None``
            (default) means on when compressed.
        block_size: elements per block of the 8-, 4-, 2- and 1-bit codes.
        warmup_steps: steps of plain float32 gradient allreduce before the first inner phase.
        hierarchical: average inside each node in float32 first and exchange among node leaders only. ``None``
            (default): ``True`` under ``with_bagua``'s data-parallel engine. On sharded replicas
            (``with_bagua(..., device_mesh=...)``) each shard's pseudo-gradient is averaged over its replica group
            flat, so ``True`` is refused there with a ``ValueError``: leave it unset or pass ``False``.
            ``contrib.DiLoCoOptimizer`` always averages flat.
        offload_outer_state: keep the global weights and the outer optimizer's state in (pinned) CPU memory.
        fault_tolerance: a :class:`~bagua.torch_api.fault.replica.FaultTolerance`: this process is one worker of
            a job whose workers fail alone (docs/fault_tolerance.md); the model joins the job when it is wrapped.
        outer_lr_warmup: the default outer optimizer's learning rate rises linearly over this many outer steps of
            each fragment (``outer_lr * k / W`` at its ``k``-th, from 1); 0: none; ``"auto"`` (default): the
            rule's (10 up to ``H = 20``) when ``outer_lr`` is ``"auto"`` too, else none.
        codec: the same choice as ``compression`` under the keyword every algorithm takes (ByteGrad's, QAdam's);
            pass one of the two. After construction both hold the codec's registered name.
        asynchronous: asynchronous DiLoCo, for workers of unequal or changing speeds: a worker's pseudo-gradient is
            applied when it arrives (by a server thread on rank 0, token-weighted, with delayed Nesterov against
            staleness) and the worker goes on from the newest global weights without waiting for the others
            (:mod:`bagua.torch_api.ops.diloco_async`). Call ``model.bagua_ddp.close()`` (``DiLoCoOptimizer.close()``)
            on every rank when training ends: all then hold the same final global weights. A ``compression``
            codec compresses both directions (error feedback up, the server's mirror of each worker's copy down).
            Needs ``fragments=1``, ``overlap_steps=0`` and the default outer optimizer; it checkpoints only after
            ``close()`` (yet). With ``fault_tolerance`` every worker applies every arrival in the order the
            coordinator's store gives them (:mod:`bagua.torch_api.ops.diloco_async_ft`). Default ``False``.
        rounds: ``"steps"`` (default: every worker takes ``sync_every`` inner steps per round) or ``"time"``
            (workers of different speeds: each round, the fastest worker takes ``sync_every`` steps and a slower
            one ``round(sync_every * t_fastest / t_own)``, from the compute seconds per step each measured last
            round, so all reach the exchange together; the average weighs each pseudo-gradient by its samples, 1
            per step unless ``driver.add_samples(n)``). Equal speeds give ``"steps"``' weights, bit for bit. Each
            round's record is in ``driver.records`` (docs/algorithms/diloco.md). Not on sharded replicas (yet).
        speed_tolerance: with ``rounds="time"``, a worker at most this fraction slower than the fastest takes
            ``sync_every`` steps (default 0.1).
        sync_every_max: links that change: after each round, when the exchange took more than
            ``max_exchange_share`` of the round's compute, the fastest worker's steps per round rise (up to this),
            and fall back towards ``sync_every`` when the link recovers (below half the share). ``None`` (default):
            off. It changes the number of inner steps per round, hence the weights: opt in.
        max_exchange_share: see ``sync_every_max`` (default 0.1: an exchange at most a tenth of the compute).

    Example:
        >>> algorithm = DiLoCoAlgorithm(sync_every=100, fragments=4, overlap_steps=2, compression="uint4")
        >>> model = model.with_bagua([torch.optim.AdamW(model.parameters())], algorithm)  # doctest: +SKIP
    """

    owner: ClassVar[str] = "DiLoCoAlgorithm"
    #: how :class:`~bagua.torch_api.sharded.replicas.ShardedReplicas` runs it (asked, so a subclass runs too)
    replica_hook: ClassVar[str] = "diloco"

    # The one live object among the fields: the documented way to make a wrapped model one worker of a
    # fault-tolerant job (``with_bagua``'s signature is every algorithm's, so the algorithm is the only
    # per-algorithm channel from the user to the engine). The settings proper (:class:`DiLoCoSettings`) hold
    # none; the run (:class:`~bagua.torch_api.ops.diloco_driver.DiLoCoDriver`) takes the communicator apart.
    fault_tolerance: Optional[FaultTolerance] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fault_tolerance is not None:
            if not isinstance(self.fault_tolerance, FaultTolerance):
                raise ValueError("DiLoCoAlgorithm(fault_tolerance=...) takes a bagua.torch_api.fault.FaultTolerance, "
                                 f"got {self.fault_tolerance!r}")
            check_fault_tolerant_settings(self, self.owner)

    def reify(self, process_group: BaguaProcessGroup) -> DiLoCoAlgorithmImpl:
        return DiLoCoAlgorithmImpl(process_group, self)
