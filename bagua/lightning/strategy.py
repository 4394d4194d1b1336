"""``BaguaStrategy``: Lightning's DDP strategy with the communication done by a Bagua algorithm.

The strategy is Lightning's ``DDPStrategy`` with four moments changed:

1. ``setup_distributed``: ``torch.distributed`` and Bagua are initialized once per process, from the cluster
   environment (a TCP rendezvous at ``main_address:main_port``, the world size, ``LOCAL_WORLD_SIZE`` = the
   Trainer's ``devices``), unless the process already did it;
2. ``setup``: the optimizers are created *before* the model is wrapped (Bagua takes them when wrapping), then
   the LightningModule is wrapped in :class:`LightningBaguaModule` and Bagua's ``DistributedDataParallel``
   with ``Algorithm.init(algorithm, **bagua_kwargs)``; an algorithm with a background loop (``async``) is
   resumed;
3. ``block_backward_sync`` (gradient accumulation, ``toggle_model(sync_grad=False)``) enters Bagua's
   ``no_sync()``;
4. ``teardown`` aborts a background loop, closes the engine (hooks, communication thread) and unwraps.

``reduce`` and ``barrier`` use Bagua's collectives; ``broadcast`` of arbitrary Python objects uses
``torch.distributed.broadcast_object_list``, i.e. pickle between the processes of the job (Bagua's own
``broadcast_object`` is JSON-only).

This module does not import Lightning: :class:`BaguaStrategyBase` is a mixin that the concrete classes in
:mod:`bagua.lightning.for_lightning` and :mod:`bagua.lightning.for_pytorch_lightning` put in front of the
matching ``DDPStrategy``.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
from types import SimpleNamespace
from typing import Any, ClassVar, Iterator, Optional, Union

import torch
import torch.distributed as dist

import bagua.torch_api as bagua
from bagua.lightning.process_group import (QADAM_OPTIMIZER_KWARG, broadcast_module_state, check_algorithm_arguments,
                                           init_bagua_process_group, to_bagua_reduce_op)
from bagua.torch_api import communication as comm
from bagua.torch_api import env
from bagua.torch_api.algorithms import Algorithm
from bagua.torch_api.communication import ReduceOp
from bagua.torch_api.data_parallel import DistributedDataParallel

__all__ = ["BaguaStrategyBase", "LightningBaguaModule", "to_bagua_reduce_op", "init_bagua_process_group"]

log = logging.getLogger(__name__)

#: The QAdam algorithm's name (its optimizer is handed over as ``QADAM_OPTIMIZER_KWARG``).
_QADAM = "qadam"
_START_METHODS = ("popen", "spawn", "fork", "forkserver")
_module_counter = itertools.count()


class LightningBaguaModule(torch.nn.Module):
    """The module Bagua wraps: a pass-through to the LightningModule that shares its train/eval mode.

    Lightning reroutes ``training_step`` through the wrapper's ``forward``, and a ``training_step`` usually
    calls ``self(x)``; Bagua's forward-pre hook sits on this outer module so that it runs once per step, not once
    per call of the LightningModule. Lightning toggles train/eval on the LightningModule only, so ``training``
    reads and writes the LightningModule's flag (the hook skips evaluation forwards by reading it).

    Args:
        pl_module: the LightningModule.
    """

    def __init__(self, pl_module: torch.nn.Module) -> None:
        super().__init__()
        self.module = pl_module
        # Unique in the job and equal on every rank (every rank wraps its modules in the same order).
        self._bagua_module_name = f"{type(pl_module).__name__}_{next(_module_counter)}"

    @property
    def training(self) -> bool:  # type: ignore[override]
        modules = self.__dict__.get("_modules")
        return modules["module"].training if modules and "module" in modules else True

    @training.setter
    def training(self, mode: bool) -> None:
        # nn.Module.__init__ assigns `training` before `_modules` exists; there is nothing to forward to yet.
        modules = self.__dict__.get("_modules")
        if modules and "module" in modules:
            modules["module"].training = mode

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class BaguaStrategyBase:
    """Train with a Bagua algorithm under Lightning (methods put in front of Lightning's ``DDPStrategy``).

    Use the concrete :class:`bagua.lightning.BaguaStrategy`, or ``Trainer(strategy="bagua")``.

    Args:
        algorithm: a registered algorithm name (``"gradient_allreduce"``, ``"bytegrad"``, ``"decentralized"``,
            ``"low_precision_decentralized"``, ``"qadam"``, ``"async"``, ...) or an ``Algorithm`` instance.
        flatten: make the communicated tensors views of flat bucket buffers (Bagua's ``do_flatten``).
        accelerator: Lightning's accelerator (set by the Trainer when omitted).
        parallel_devices: the devices of this node (set by the Trainer when omitted).
        cluster_environment: where ranks come from; :class:`BaguaEnvironment` under a Bagua launcher, otherwise
            the Trainer's choice.
        checkpoint_io: Lightning's checkpoint plugin.
        precision_plugin: Lightning's precision plugin.
        find_unused_parameters: give parameters unused on every rank a ``None`` gradient, as torch DDP does.
        start_method: how Lightning starts the processes when no launcher did: ``"popen"`` (re-run the script),
            ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        timeout: limit of every collective; default ``BAGUA_COMM_TIMEOUT_S`` (300 s).
        **bagua_kwargs: the algorithm's hyper-parameters, e.g. ``hierarchical=False``. For ``"qadam"`` the
            optimizer comes from ``configure_optimizers``, which must return exactly one ``QAdamOptimizer``.

    Example:
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy="bagua")  # doctest: +SKIP
        >>> trainer = Trainer(strategy=BaguaStrategy(algorithm="bytegrad", hierarchical=False))  # doctest: +SKIP
    """

    strategy_name = "bagua"
    #: Lightning symbols of the concrete class's flavor (see :func:`bagua.lightning._api.load`).
    _api: ClassVar[SimpleNamespace]
    #: The ``BaguaEnvironment`` of the same flavor.
    _environment_cls: ClassVar[type]

    def __init__(
        self,
        algorithm: Union[str, Algorithm] = "gradient_allreduce",
        flatten: bool = True,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        find_unused_parameters: bool = False,
        start_method: str = "popen",
        timeout: Optional[datetime.timedelta] = None,
        **bagua_kwargs: Any,
    ) -> None:
        check_algorithm_arguments(algorithm, bagua_kwargs)
        if not isinstance(flatten, bool):
            raise ValueError(f"BaguaStrategy(flatten=...) must be True or False, got {flatten!r}")
        if start_method not in _START_METHODS:
            raise ValueError(f"BaguaStrategy(start_method={start_method!r}) must be one of {list(_START_METHODS)}")
        if cluster_environment is None and self._environment_cls.detect():
            cluster_environment = self._environment_cls()
        super().__init__(  # type: ignore[call-arg]
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            start_method=start_method,
            timeout=timeout if timeout is not None else datetime.timedelta(seconds=env.get_comm_timeout_s()),
        )
        # user settings
        self._bagua_algorithm = algorithm
        self._bagua_flatten = flatten
        self._bagua_kwargs = dict(bagua_kwargs)
        self._bagua_find_unused_parameters = find_unused_parameters

    @property
    def algorithm(self) -> Union[str, Algorithm]:
        """The algorithm's name (or instance) given to the constructor."""
        return self._bagua_algorithm

    @property
    def bagua_kwargs(self) -> dict[str, Any]:
        """The algorithm's hyper-parameters given to the constructor."""
        return dict(self._bagua_kwargs)

    # -- processes -------------------------------------------------------------------------------------------

    def setup_distributed(self) -> None:
        """Initialize ``torch.distributed`` and Bagua for this process (once; a launcher may have done it)."""
        self._api.reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        if self.cluster_environment.creates_processes_externally:
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not comm.is_initialized():
            init_bagua_process_group(
                self.cluster_environment.main_address,
                self.cluster_environment.main_port,
                self._process_group_backend,
                rank=self.global_rank,
                world_size=self.world_size,
                local_world_size=self.num_processes,
                timeout=self._timeout,
            )
        if self.root_device.type == "cuda":
            # Bagua picks the GPU from LOCAL_RANK; Lightning's devices=[...] may map ranks to other GPUs.
            torch.cuda.set_device(self.root_device)

    # -- model -----------------------------------------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        """Move the model, create the optimizers, then wrap the model with Bagua (when fitting)."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == "fit"
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            # Unlike torch DDP, Bagua needs the optimizers when it wraps the model (it hooks their step).
            self.setup_optimizers(trainer)
            self._configure_bagua_model(trainer)
        else:
            broadcast_module_state(self.model)
        self.setup_precision_plugin()
        if fitting:
            self._api.optimizers_to_device(self.optimizers, self.root_device)
            self._resume_background_communication()

    def _configure_bagua_model(self, trainer: Any) -> None:
        """Wrap the LightningModule with Bagua, using the optimizers already set up (the original plugin's name).

        The original lightning-bagua plugin, and its tests, call this after ``setup_optimizers``. An algorithm
        with a background loop (``async``) is resumed by :meth:`setup`, once the optimizers are on their device.
        """
        self.model = self._setup_model(self.model)

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        """Wrap the LightningModule with Bagua's ``DistributedDataParallel``."""
        optimizers = [o._optimizer if isinstance(o, self._api.LightningOptimizer) else o for o in self.optimizers]
        algorithm = self._make_algorithm(optimizers)
        log.debug("%s: wrapping the model with %r", type(self).__name__, algorithm)
        return DistributedDataParallel(
            LightningBaguaModule(model),
            optimizers=optimizers,
            algorithm=algorithm,
            gradient_as_bucket_view=self._bagua_flatten,
            find_unused_parameters=self._bagua_find_unused_parameters,
        )

    def _make_algorithm(self, optimizers: list[torch.optim.Optimizer]) -> Algorithm:
        if isinstance(self._bagua_algorithm, Algorithm):
            return self._bagua_algorithm
        kwargs = dict(self._bagua_kwargs)
        if self._bagua_algorithm == _QADAM:
            kwargs[QADAM_OPTIMIZER_KWARG] = self._the_qadam_optimizer(optimizers)
        return Algorithm.init(self._bagua_algorithm, **kwargs)

    def _the_qadam_optimizer(self, optimizers: list[torch.optim.Optimizer]) -> torch.optim.Optimizer:
        from bagua.torch_api.algorithms.q_adam import QAdamOptimizer

        if len(optimizers) != 1 or not isinstance(optimizers[0], QAdamOptimizer) or len(self.lr_scheduler_configs) > 1:
            found = [type(o).__name__ for o in optimizers]
            raise self._api.MisconfigurationException(
                "Bagua QAdam can only accept one QAdamOptimizer and one LR Scheduler. "
                f"configure_optimizers() returned optimizers {found} and {len(self.lr_scheduler_configs)} "
                "scheduler(s); return exactly one bagua.torch_api.algorithms.q_adam.QAdamOptimizer and at most one "
                "scheduler, or choose another algorithm"
            )
        return optimizers[0]

    def _resume_background_communication(self) -> None:
        # Algorithms that communicate on a background loop (async model averaging) have resume()/abort();
        # the loop runs while fitting and must be stopped before the processes leave the job.
        if isinstance(self.model, DistributedDataParallel):
            resume = getattr(self.model.bagua_algorithm, "resume", None)
            if resume is not None:
                resume(self.model)

    def _abort_background_communication(self, model: DistributedDataParallel) -> None:
        abort = getattr(model.bagua_algorithm, "abort", None)
        if abort is not None:
            abort(model)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block (Bagua's ``no_sync``)."""
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    def teardown(self) -> None:
        """Stop background communication, close Bagua's engine and unwrap the LightningModule."""
        model = self.model
        if isinstance(model, DistributedDataParallel):
            try:
                self._abort_background_communication(model)
                model.inner.close()
            finally:
                self.model = self.lightning_module
        super().teardown()  # type: ignore[misc]

    # -- collectives -----------------------------------------------------------------------------------------

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Wait for every process (Bagua's ``barrier``)."""
        if comm.is_initialized():
            comm.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s ``obj`` on every rank; any picklable object (pickle within the job)."""
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def reduce(
        self,
        tensor: Any,
        group: Optional[Any] = None,
        reduce_op: Union[str, ReduceOp, dist.ReduceOp, None] = "mean",
    ) -> Any:
        """Reduce ``tensor`` over all ranks in place and return it; non-tensors are returned unchanged.

        Args:
            tensor: the value to reduce.
            group: must be ``None`` (all ranks).
            reduce_op: ``"mean"``/``"avg"``, ``"sum"``, ``"max"``, ``"min"``, ``"product"``, ``"band"``,
                ``"bor"``, ``"bxor"``, a ``torch.distributed.ReduceOp`` or a Bagua ``ReduceOp``.
        """
        if group is not None:
            raise ValueError("BaguaStrategy.reduce reduces over all processes; call it with group=None")
        if not isinstance(tensor, torch.Tensor):
            return tensor
        op = to_bagua_reduce_op(reduce_op)
        if comm.is_initialized():
            comm.allreduce_inplace(tensor, op)
        return tensor

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register this class as ``"bagua"`` in Lightning's strategy registry."""
        strategy_registry.register(
            "bagua", cls, description="Bagua: communication-efficient data-parallel training", override=True
        )
