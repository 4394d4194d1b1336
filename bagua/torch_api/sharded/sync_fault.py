"""Synchronous steps that outlive a dead replica on FSDP2-sharded replicas: a quorum of live replicas per step.

``GradientAllReduceAlgorithm(fault_tolerance=ft)`` and ``ByteGradAlgorithm(fault_tolerance=ft, codec=...)`` passed to
``with_bagua(..., device_mesh=mesh, replicate_dim=...)`` with a ``(1, S)`` mesh: each replica is a job of its own (its
S shard ranks, one launcher each), which may fail alone. :class:`ShardedSyncSteps` drives one
:class:`ShardSteps` per shard rank (:class:`~bagua.torch_api.fault.synchronous.SyncSteps` on the rank's local
shards):

1. a forward pre-hook (prepended, before FSDP2 all-gathers the weights) joins the job when this replica is not in
   it (healing its shard, weights and the optimizer's whole state, from the same shard of a live peer) and starts
   the step's agreement on a thread; the replica's first rank agrees with the coordinator and shares the quorum
   with its other ranks (:mod:`~bagua.torch_api.fault.ranks`), so all shards of a replica run the same quorum;
2. at the end of the backward (a callback queued from FSDP2's all-reduce hook, after FSDP2 has written every
   sharded gradient), each rank averages its shards' gradients over the same shard of the step's live replicas,
   weighted by their samples (a dead replica's share goes to the living); the step commits only when the exchange
   was ``ok`` on every shard of every member, otherwise every shard runs it again without the dead. The user's
   ``optimizer.step()`` then applies the same average on every replica: plain HSDP's maths over the live ones.

Example:
    >>> mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))  # doctest: +SKIP
    >>> ft = FaultTolerance("10.0.0.1:29600", worker="replica-0", workers=4)  # doctest: +SKIP
    >>> model.with_bagua([opt], GradientAllReduceAlgorithm(fault_tolerance=ft), device_mesh=mesh,
    ...                  replicate_dim="replicate")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from bagua.torch_api.fault.heal import flatten_optimizer_state, unflatten_optimizer_state
from bagua.torch_api.fault.replica import FaultTolerance
from bagua.torch_api.fault.synchronous import OPTIMIZER_PREFIX, SyncSteps

__all__ = ["ShardSteps", "ShardedSyncSteps"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (a view: writing it writes ``t``), ``t`` otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _sharded_state(params: list[torch.nn.Parameter], state: dict[Any, Any]) -> dict[Any, Any]:
    """An optimizer's per-parameter state of this rank's shards (plain tensors), each laid out as its (DTensor)
    parameter again."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, entry in state.items():
        p = params[int(k)]
        if isinstance(p, DTensor):
            shape = p.to_local().shape
            entry = {n: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
                     if torch.is_tensor(v) and v.dim() > 0 and v.shape == shape else v for n, v in entry.items()}
        out[k] = entry
    return out


class ShardSteps(SyncSteps):
    """:class:`~bagua.torch_api.fault.synchronous.SyncSteps` on this rank's shards of FSDP2's (DTensor) parameters.

    :class:`SyncSteps` runs on plain tensors standing for the local shards (views: writing one writes the
    parameter); around each step's exchange, :meth:`after_backward` hands them the local shards of the sharded
    gradients (views too, so the average lands in ``param.grad``). What a joiner takes from the same shard rank of a
    live peer: the step counter, the weight shards and the optimizer's whole state on this rank (Adam's moments as
    shards, laid out as the parameters again on the joiner). The settings every member shares name the full
    parameters (the same on every shard rank, also when FSDP2 shards them unevenly).

    Example:
        >>> steps = ShardSteps(ft, list(model.parameters()), opt)  # doctest: +SKIP
    """

    def __init__(self, ft: FaultTolerance, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 codec: Optional[str] = None, block_size: int = 4096, error_feedback: bool = False,
                 name: str = "gradient_allreduce", buffers: Sequence[torch.Tensor] = ()) -> None:
        #: the (DTensor) parameters, whose local shards the steps read and write
        self.sharded = list(params)
        self._shards = [_local(p).detach() for p in self.sharded]  # what SyncSteps sees: views of the shards
        super().__init__(ft, self._shards, optimizer, codec=codec, block_size=block_size,
                         error_feedback=error_feedback, name=name, buffers=[_local(b) for b in buffers])

    NEEDS = "the same model, algorithm and codec, sharded over as many ranks"

    def _whole(self) -> list[torch.Tensor]:
        """The whole (DTensor) parameters: the local shards of one replica's ranks differ in size."""
        return self.sharded

    def _refresh(self) -> None:
        """Point the stand-ins at the parameters' local shards again (FSDP2 may have re-made them)."""
        for shard, p in zip(self._shards, self.sharded):
            local = _local(p)
            if shard.data_ptr() != local.data_ptr() or shard.shape != local.shape:
                shard.data = local.detach()

    def before_forward(self) -> None:
        """Join the job when not yet in it (healing this rank's shards), count the step and start its agreement."""
        self._refresh()
        super().before_forward()

    @torch.no_grad()
    def after_backward(self) -> None:
        """Average the local shards of the step's gradients over the same shard of the live replicas (into
        ``param.grad``, what ``optimizer.step()`` applies next)."""
        from torch.distributed.tensor import DTensor

        self._refresh()
        for shard, p in zip(self._shards, self.sharded):
            shard.grad = _local(p.grad) if p.grad is not None else None
        try:
            super().after_backward()
            for shard, p in zip(self._shards, self.sharded):
                if p.grad is None and shard.grad is not None:  # a parameter the backward did not reach
                    p.grad = (DTensor.from_local(shard.grad, p.device_mesh, p.placements, run_check=False,
                                                 shape=p.shape, stride=p.stride())
                              if isinstance(p, DTensor) else shard.grad)
        finally:
            for shard in self._shards:
                shard.grad = None

    def heal_state_dict(self) -> dict[str, torch.Tensor]:
        """What the same shard rank of a joiner takes: :class:`SyncSteps`'s, every tensor as this rank's shard."""
        return {k: _local(v) for k, v in super().heal_state_dict().items()}

    @torch.no_grad()
    def load_heal_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take a peer's :meth:`heal_state_dict` into this rank's shards, the optimizer's state laid out as the
        parameters; the error-feedback residual starts at zero."""
        self._refresh()
        opt = {k: v for k, v in state.items() if k.startswith(OPTIMIZER_PREFIX)}
        tree = unflatten_optimizer_state(opt, prefix=OPTIMIZER_PREFIX)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        tree["state"] = _sharded_state(params, tree["state"])
        rest = {k: v for k, v in state.items() if not k.startswith(OPTIMIZER_PREFIX)}
        super().load_heal_state_dict({**rest, **flatten_optimizer_state(tree, prefix=OPTIMIZER_PREFIX)})


class ShardedSyncSteps:
    """Run each step of an FSDP2-sharded replica as a round over the live replicas (see the module docstring).

    Args:
        module: the model, ``fully_shard``-ed over this replica's ranks.
        optimizers: the optimizer stepping it, one (its whole state heals a joiner, shard by shard).
        algorithm: ``GradientAllReduceAlgorithm`` or ``ByteGradAlgorithm`` with ``fault_tolerance=``.
        hook: how the algorithm exchanges (``"allreduce"`` or ``"bytegrad"``).

    Attributes: ``steps`` (this rank's :class:`ShardSteps`), ``handles`` (the hooks to remove on close).

    Example:
        >>> sync = ShardedSyncSteps(model, [opt], GradientAllReduceAlgorithm(fault_tolerance=ft),
        ...                         "allreduce")  # doctest: +SKIP
    """

    def __init__(self, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], algorithm: Any,
                 hook: str) -> None:
        ft = algorithm.fault_tolerance
        if not isinstance(ft, FaultTolerance):
            raise ValueError(f"{type(algorithm).__name__}(fault_tolerance=...) takes a "
                             f"bagua.torch_api.fault.FaultTolerance, got {ft!r}")
        if len(optimizers) != 1:
            raise ValueError(f"{type(algorithm).__name__}(fault_tolerance=...) heals a joining replica with one "
                             f"optimizer's state; with_bagua got {len(optimizers)}: step the model with one")
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(algorithm).__name__}(fault_tolerance=...): the model has no trainable parameter")
        codec = getattr(algorithm, "codec", None) if hook == "bytegrad" else None
        self.module = module
        self.steps = ShardSteps(ft, params, optimizers[0], codec=codec,
                                block_size=getattr(algorithm, "block_size", 4096),
                                error_feedback=bool(getattr(algorithm, "error_feedback", False)) and codec is not None,
                                name=f"{type(algorithm).__name__} (sharded)", buffers=list(module.buffers()))
        self._queued = False  # this backward's end-of-backward exchange is queued
        # prepended: before FSDP2 all-gathers the weights, which a joiner's heal writes
        self.handles: list[Any] = [module.register_forward_pre_hook(lambda *_: self._before_forward(), prepend=True)]

    def _before_forward(self) -> None:
        self._queued = False  # a backward that failed dropped its callback: the next one queues its own
        self.steps.before_forward()

    def reduce_hook(self, reduce_output: torch.Tensor) -> None:
        """FSDP2's all-reduce hook of every unit: queue the step's exchange once, at the end of the backward (after
        FSDP2's own final callback has written every sharded gradient)."""
        if self._queued:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._queued = False
        self.steps.after_backward()

    def close(self) -> None:
        """Remove the forward pre-hook."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
