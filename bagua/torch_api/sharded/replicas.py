"""Bagua's algorithms on the replicate dimension of a model sharded with FSDP2 over the other dimension.

FSDP2 owns the shard dimension: it all-gathers weights for forward and backward and reduce-scatters gradients over
the ranks of one replica. Bagua owns the replicate dimension: each rank exchanges only its own shard, with the
ranks that hold the same shard in the other replicas, on a process group of Bagua's own. How a replica exchanges
is asked of the algorithm (:func:`replica_hook`), never read from its class name, so a user's subclass runs as the
algorithm it extends:

- ``gradient_allreduce``: FSDP2's all-reduce hook averages each unit's reduce-scatter output over the replicas
  (plain HSDP's maths);
- ``bytegrad``: the same point, through a compressed allreduce (chunk, uint8 or uint4 code), its error-feedback
  residuals sharded like the gradient (one workspace per FSDP2 unit);
- both exchanges overlap the rest of the backward, as native HSDP's all-reduce does: started in the hook (an
  asynchronous ``all_reduce``; ByteGrad's on a communication thread) and waited for at the end of the backward,
  before an optimizer step, a checkpoint and :meth:`ShardedReplicas.close`, with the same numbers bit for bit. A
  unit whose gradients FSDP2 copies after the hook (float16 or mixed-precision reduction, gradient accumulation, CPU
  offload, post-accumulate-grad hooks: :mod:`bagua.torch_api.sharded.overlap`) exchanges synchronously in the hook,
  as do all units with ``overlap=False`` or ``BAGUA_SHARDED_OVERLAP=0``;
- ``diloco`` (and streaming DiLoCo): no exchange at inner steps; every ``sync_every`` steps the pseudo-gradient of
  this rank's shard is averaged over the replicas and the outer step runs on the shard. Global weights, outer
  momentum and residuals are held per shard (1/S of the unsharded amount); fragments are whole FSDP2 units. The
  replicas average flat: ``DiLoCoAlgorithm(hierarchical=True)`` is refused (leave it unset, or ``False``).
  With ``rounds="time"`` or ``sync_every_max``, each report row is reduced over the shards of its replica first
  (the replica's slowest step time, its tokens), so every shard of a replica takes the same inner steps.
  With ``DiLoCoAlgorithm(fault_tolerance=...)`` each replica is a job of its own that may fail alone (a ``(1, S)``
  mesh per worker): the shards are averaged over the round's live workers (:mod:`bagua.torch_api.fault.replica`).
  So do gradient allreduce and ByteGrad with ``fault_tolerance=...``: each step's gradient shards are averaged
  over a quorum of live replicas (:mod:`bagua.torch_api.sharded.sync_fault`).

Example:
    >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # doctest: +SKIP
    >>> for block in model.blocks: fully_shard(block, mesh=mesh["shard"])  # doctest: +SKIP
    >>> fully_shard(model, mesh=mesh["shard"])  # doctest: +SKIP
    >>> model.with_bagua([optimizer], DiLoCoAlgorithm(sync_every=50), device_mesh=mesh,
    ...                  replicate_dim="replicate")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from bagua.torch_api.codecs.workspace import AnyWorkspace, compressed_allreduce_inplace, make_workspace
from bagua.torch_api.comm.process_group import BaguaCommunicator
from bagua.torch_api.communication import ReduceOp
from bagua.torch_api import communication as comm
from bagua.torch_api.comm.own_group import own_communicator, release_at_exit
from bagua.torch_api.comm.worker import CommWorker
from bagua.torch_api.ops.diloco_driver import DiLoCoDriver
from bagua.torch_api.sharded.checkpoint import load_sharded_state_dict, sharded_state_dict
from bagua.torch_api.sharded.mesh import check_mesh, fsdp_units, local_shard, replica_groups
from bagua.torch_api.sharded.overlap import PendingExchanges, can_overlap, overlap_default
from bagua.torch_api.sharded.sync_fault import ShardedSyncSteps

__all__ = ["ShardedReplicas", "SUPPORTED", "replica_hook"]

#: the built-in algorithms whose maths carries over to a sharded replica (and their subclasses)
SUPPORTED = ("GradientAllReduceAlgorithm", "ByteGradAlgorithm", "DiLoCoAlgorithm")
#: what :func:`replica_hook` may answer: how a replica exchanges
HOOKS = ("allreduce", "bytegrad", "diloco")


def replica_hook(algorithm: Any) -> Optional[str]:
    """Ask ``algorithm`` how it runs on sharded replicas: its ``replica_hook`` class attribute (one of :data:`HOOKS`,
    declared by ``GradientAllReduceAlgorithm``, ``ByteGradAlgorithm`` and ``DiLoCoAlgorithm``, so inherited by a
    user's subclass); ``None``: it does not run there."""
    hook = getattr(algorithm, "replica_hook", None)
    if hook is not None and hook not in HOOKS:
        raise ValueError(f"{type(algorithm).__name__}.replica_hook={hook!r} names no sharded-replica exchange; "
                         f"choose one of {HOOKS}")
    return hook


def _why_not(algorithm: Any) -> str:
    """Why ``algorithm`` does not run on sharded replicas: its ``replica_refusal`` class attribute, if it says."""
    return getattr(algorithm, "replica_refusal", "it is not written for sharded replicas")


class ShardedReplicas:
    """Run ``algorithm`` over the replicas of an FSDP2-sharded ``module`` (what ``with_bagua(..., device_mesh=...)``
    builds; reachable as ``module.bagua_sharded``).

    Building it is collective over every rank of the mesh (it creates one process group per replica group) and
    broadcasts each shard from the first replica, so the replicas start equal. It is a ``torch.distributed.checkpoint``
    ``Stateful``: save it beside the model's and the optimizer's state (see :mod:`bagua.torch_api.sharded.checkpoint`).

    Args:
        module: the model, ``fully_shard``-ed over the shard dimension of ``device_mesh`` only.
        optimizers: the optimizers stepping its (sharded) parameters; DiLoCo counts the steps of the first.
        algorithm: a :class:`~bagua.torch_api.algorithms.gradient_allreduce.GradientAllReduceAlgorithm`,
            :class:`~bagua.torch_api.algorithms.bytegrad.ByteGradAlgorithm` or
            :class:`~bagua.torch_api.algorithms.diloco.DiLoCoAlgorithm`.
        device_mesh: a 2-D ``DeviceMesh`` with named dimensions.
        replicate_dim: the name of the dimension Bagua communicates over.
        overlap: gradient allreduce and ByteGrad: let the replica exchanges run while the backward goes on (see
            :mod:`bagua.torch_api.sharded.overlap`); ``False`` runs them inside FSDP2's hook. Default:
            ``BAGUA_SHARDED_OVERLAP`` (``1``). The numbers are the same either way.
    """

    def __init__(self, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], algorithm: Any,
                 device_mesh: Any, replicate_dim: str, overlap: Optional[bool] = None) -> None:
        name = type(algorithm).__name__
        #: how this rank's replica exchanges: asked of the algorithm (see :func:`replica_hook`)
        self.hook = replica_hook(algorithm)
        if self.hook is None:
            raise ValueError(f"{name} does not run on sharded replicas (device_mesh=...): {_why_not(algorithm)}. "
                             f"Supported there: {', '.join(SUPPORTED)} (and their subclasses)")
        if not optimizers:
            raise ValueError("with_bagua(optimizers, ..., device_mesh=...) needs the optimizer(s) of the model")
        if self.hook == "diloco" and getattr(algorithm, "hierarchical", None) is True:
            raise ValueError(f"{name}(hierarchical=True) does not run on sharded replicas (device_mesh=...): each "
                             "shard's pseudo-gradient is averaged over its replica group, flat (with one replica "
                             "per node, HSDP's usual layout, that is what hierarchical would do anyway); leave "
                             "hierarchical unset or pass hierarchical=False")
        if self.hook == "bytegrad" and (algorithm.grad_scaler is not None or algorithm.nonfinite != "propagate"):
            raise ValueError("ByteGradAlgorithm on sharded replicas supports neither grad_scaler= nor nonfinite= "
                             "other than 'propagate' yet (residuals are not rescaled, no finite check runs): leave "
                             "both at their defaults; a non-finite gradient then reaches every replica, so "
                             "GradScaler skips the step everywhere")
        index, shard_dim = check_mesh(device_mesh, replicate_dim)
        self.fault = getattr(algorithm, "fault_tolerance", None)
        if self.fault is not None and device_mesh.mesh.shape[index] != 1:
            raise ValueError(f"{name}(fault_tolerance=...) with device_mesh=...: each worker is one replica "
                             f"(its own job; the replicas are the workers), but the mesh's {replicate_dim!r} "
                             f"dimension has {device_mesh.mesh.shape[index]}; build the mesh as (1, shards), e.g. "
                             "init_device_mesh('cpu', (1, world_size), mesh_dim_names=('replicate', 'shard'))")
        # user settings
        self.module, self.algorithm = module, algorithm
        self.optimizer = optimizers[0]
        self.optimizers = list(optimizers)
        #: whether gradient allreduce and ByteGrad overlap their exchanges with the backward (read at every hook)
        self.overlap = overlap_default() if overlap is None else overlap
        # the replicas: a communicator of Bagua's own over this rank's replica group (collective: every rank
        # creates every group, in mesh order)
        rank = dist.get_rank()
        groups = replica_groups(device_mesh.mesh, index)
        mine = [g for g in groups if rank in g][0]
        for ranks in groups:
            c = own_communicator(ranks)
            if ranks == mine:
                self.communicator: BaguaCommunicator = c
        shard_ranks = device_mesh[shard_dim].mesh.flatten().tolist()
        #: DiLoCo's rounds by time and link rule: a communicator over this rank's replica (its shards), over which
        #: each report row is reduced, so that every shard of a replica plans the same inner steps
        self.shard_communicator: Optional[BaguaCommunicator] = None
        paced = getattr(algorithm, "rounds", "steps") == "time" or getattr(algorithm, "sync_every_max",
                                                                              None) is not None
        if self.hook == "diloco" and self.fault is None and paced and len(shard_ranks) > 1:
            for ranks in replica_groups(device_mesh.mesh, 1 - index):  # collective, in mesh order
                c = own_communicator(ranks)
                if rank in ranks:
                    self.shard_communicator = c
        #: where this rank sits: (replica index, shard index) of (replicas, shards per replica)
        self.position = (self.communicator.rank(), shard_ranks.index(rank))
        self.mesh_shape = (len(mine), len(shard_ranks))
        # this rank's shards, by FSDP2 unit (model order), and by name for checkpoints
        named = [[(n, p, local_shard(n, p, shard_ranks)) for n, p in unit] for unit in fsdp_units(module)]
        self.units = [[(s, p.numel() * p.element_size()) for _, p, s in unit] for unit in named]
        self.named_shards = [entry for unit in named for entry in unit]
        self._broadcast_shards()
        if self.fault is not None:  # collective: this worker's ranks share its quorums
            self.fault.bind_ranks(device_mesh.mesh.flatten().tolist())
        # per-algorithm state
        self._workspaces: dict[int, AnyWorkspace] = {}
        self.driver: Optional[DiLoCoDriver] = None
        self._counted = False  # this step's backward has been counted
        self._warm = False  # and it was a warm-up step
        self._handles: list[Any] = []
        self._exchanges = PendingExchanges(self.communicator, "sharded replicas")
        #: gradient allreduce and ByteGrad with fault_tolerance: each step a round over the live replicas
        self.sync: Optional[ShardedSyncSteps] = None
        self._install()

    # -- set-up ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _broadcast_shards(self) -> None:
        root = 0  # the communicator's first rank: the first replica
        for unit in self.units:
            for shard, _ in unit:
                if shard.numel():
                    comm.broadcast(shard, root, self.communicator)

    def _install(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        fsdp_modules = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        if self.fault is not None and self.hook != "diloco":
            self.sync = ShardedSyncSteps(self.module, self.optimizers, self.algorithm, self.hook)
            self._handles.extend(self.sync.handles)
            for m in fsdp_modules:
                m.set_all_reduce_hook(self.sync.reduce_hook)
            return
        for i, m in enumerate(fsdp_modules):
            m.set_all_reduce_hook(self._hook_for(i, m))
        if self.hook in ("allreduce", "bytegrad"):  # what is in flight lands before any optimizer steps
            for optimizer in self.optimizers:
                self._handles.append(optimizer.register_step_pre_hook(lambda *_: self._exchanges.wait()))
        if self.hook == "diloco":
            # with overlap, the exchanges travel on a thread of the driver's own while the next inner steps run
            worker = CommWorker("bagua-diloco-sharded", None) if self.algorithm.overlap_steps > 0 else None
            if self.fault is not None:  # each shard's exchanges over the same shard of the round's live workers
                self.driver = DiLoCoDriver(self.algorithm, "DiLoCo (sharded)", fault=self.fault)
            else:
                self.driver = DiLoCoDriver(self.algorithm, "DiLoCo (sharded)", communicator=self.communicator,
                                           worker=worker)
                self.driver.replica_shards = self.shard_communicator
            release_at_exit(self)
            if self.algorithm.warmup_steps == 0:
                self._build_fragments()
            # a step is counted at its backward (the first gradient exchanged), so a step GradScaler skips on
            # one replica only still counts there; its end-of-step work runs after the optimizer step, or at the
            # next forward when the optimizer did not step
            self._handles.append(self.optimizer.register_step_post_hook(lambda *_: self._end_steps()))
            # prepended: before FSDP2 all-gathers the root's own parameters, which an outer step may change
            self._handles.append(self.module.register_forward_pre_hook(lambda *_: self._on_forward(), prepend=True))

    def _build_fragments(self) -> None:
        """Fragments of whole FSDP2 units, split by the units' full sizes: every shard rank cuts the model at the
        same units, as the unsharded model would be cut when its fragments end at unit boundaries."""
        assert self.driver is not None
        locals_ = [[s for s, _ in unit if s.numel()] for unit in self.units]
        # with fault tolerance, joining the job heals each shard from the same shard of a live peer
        self.driver.begin([s for unit in locals_ for s in unit], self.optimizer, units=[len(u) for u in locals_],
                          unit_bytes=[sum(b for _, b in unit) for unit in self.units])

    # -- the moments of a step ---------------------------------------------------------------------------------

    def _hook_for(self, unit: int, fsdp_module: Any) -> Callable[[torch.Tensor], None]:
        def hook(reduce_output: torch.Tensor) -> None:
            overlap = self.overlap and self.hook != "diloco" and can_overlap(fsdp_module, reduce_output)
            self._exchange_gradient(unit, reduce_output, overlap)

        return hook

    def _exchange_gradient(self, unit: int, flat: torch.Tensor, overlap: bool = False) -> None:
        """Average one unit's reduce-scatter output over the replicas, as the algorithm says; with ``overlap``,
        start it and leave it in flight (see :mod:`bagua.torch_api.sharded.overlap`)."""
        if self.hook == "diloco":
            warm = self._count_step()
            if not warm:
                return  # inner steps: each replica trains on its own gradients
        if not overlap and len(self._exchanges):
            self._exchanges.wait()  # every rank exchanges in the same order: the ones in flight first
        if self.hook == "bytegrad":
            ws = self._workspaces.get(unit)
            if ws is None:
                a = self.algorithm
                ws = self._workspaces[unit] = make_workspace(a.codec, flat.numel(), self.communicator.nranks(),
                                                             flat.device, a.block_size, a.error_feedback)
            a, c = self.algorithm, self.communicator

            def exchange() -> None:
                compressed_allreduce_inplace(flat, ws, c, average=a.average, error_feedback=a.error_feedback, tag=unit)

            if overlap:
                self._exchanges.submit(exchange, f"ByteGrad exchange of FSDP2 unit {unit} over the replicas",
                                       cuda=flat.is_cuda)
            else:
                exchange()
            return
        if overlap:
            self._exchanges.allreduce_average(flat)
            return
        comm.allreduce_inplace(flat, ReduceOp.AVG, self.communicator)

    def _count_step(self) -> bool:
        """Count this backward's step once (at its first exchanged gradient); return whether it is a warm-up step,
        whose gradients are averaged over the replicas."""
        warm = self._warm
        if not self._counted:
            self._counted = True
            assert self.driver is not None
            warm = self._warm = self.driver.warming_up
            self.driver.count_step(warm)
        return warm

    @property
    def steps(self) -> int:
        """DiLoCo: steps counted, one per backward that exchanges gradients (the driver's count; 0 otherwise)."""
        return self.driver.steps if self.driver is not None else 0

    def _on_forward(self) -> None:
        self._end_steps()  # the previous step's, when the optimizer did not step (GradScaler skipped it)
        self._counted = False

    def _end_steps(self) -> None:
        """Run the end-of-step work of the steps counted: build the fragments once the warm-up is over, then
        finish and start the exchanges due."""
        assert self.driver is not None
        self.driver.after_steps(self._build_fragments)

    # -- checkpoints -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return this rank's state for ``torch.distributed.checkpoint`` (a DCP ``Stateful``): step counters,
        DiLoCo's outer state as per-parameter DTensors, residuals under keys naming the replica (see
        :mod:`bagua.torch_api.sharded.checkpoint`)."""
        self._exchanges.wait()
        if self.driver is not None:
            self._end_steps()  # the end-of-step work a forward would run first (collective, as the save is)
        return sharded_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, as loaded by ``torch.distributed.checkpoint.load``."""
        self._exchanges.wait()
        load_sharded_state_dict(self, state)

    # -- teardown ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop: remove the optimizer hooks and FSDP2's all-reduce hooks, finish the exchanges in flight (DiLoCo's,
        and the gradients' still running); a failed one raises once everything is removed."""
        from torch.distributed.fsdp import FSDPModule

        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.set_all_reduce_hook(lambda _: None)
        if self.driver is not None:
            self.driver.close(strict=False)
        self._exchanges.close()

    def _release_for_exit(self) -> None:
        if self.driver is not None:
            self.driver.release_for_exit()
