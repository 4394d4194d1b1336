"""``BaguaModule``: the ``with_bagua`` method and its properties on every ``torch.nn.Module``.

This is the one place where Bagua patches torch, for compatibility with the original: it added ``with_bagua`` to
``torch.nn.Module``, and existing scripts call ``model.with_bagua([optimizer], algorithm)``, so importing
``bagua.torch_api`` installs the methods of :class:`BaguaModule` on ``torch.nn.Module``. User-written algorithms
of the original call a few methods on parameters (``param.bagua_ensure_grad().ensure_bagua_tensor(...)``,
``bagua_mark_communication_ready()``; see :class:`bagua.torch_api.tensor.TensorMethods`), so the same
:func:`_install` puts those on ``torch.Tensor``; Bagua's own engine and algorithms never call them. Nothing else of
torch is patched. The module is not wrapped: ``with_bagua`` returns the same object, whose forward is untouched;
hooks do all the work.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch

from bagua.torch_api import communication as comm
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.interfaces import engine_of  # noqa: F401  (read here by checkpoint/)
from bagua.torch_api.tensor import TENSOR_METHODS, TensorMethods

if TYPE_CHECKING:
    from bagua.torch_api.data_parallel.bagua_distributed import BaguaDistributedDataParallel

__all__ = ["BaguaModule"]


class BaguaModule:
    """Methods and properties that ``import bagua.torch_api`` adds to ``torch.nn.Module``.

    Example:
        >>> import bagua.torch_api as bagua
        >>> from bagua.torch_api.algorithms import gradient_allreduce
        >>> bagua.init_process_group()  # doctest: +SKIP
        >>> model = model.with_bagua([optimizer], gradient_allreduce.GradientAllReduceAlgorithm())  # doctest: +SKIP
    """

    def with_bagua(  # type: ignore[misc]
        self: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        algorithm: Algorithm,
        process_group: Optional[BaguaProcessGroup] = None,
        do_flatten: bool = True,
        *,
        device_mesh: Optional[Any] = None,
        replicate_dim: Optional[str] = None,
    ) -> torch.nn.Module:
        """Train this module with ``algorithm`` over ``process_group``; return the same module.

        Parameters, buffers and optimizer state are broadcast from rank 0, so ranks may start from different
        weights. Calling it again with another algorithm re-wraps the module.

        Args:
            optimizers: the optimizers that step this module's parameters.
            algorithm: e.g. ``GradientAllReduceAlgorithm()`` or ``Algorithm.init("bytegrad")``.
            process_group: the group to train over; the default group when ``None``.
            do_flatten: make effective tensors views of flat bucket buffers (faster; disable when another
                component, such as a fused optimizer, must own the memory layout).
            device_mesh, replicate_dim: for a model sharded with FSDP2 (``fully_shard``) over one dimension of a
                2-D ``DeviceMesh``: run the algorithm between the replicas, over the dimension ``replicate_dim``
                (see :mod:`bagua.torch_api.sharded`); the module then has ``bagua_sharded``, not ``bagua_ddp``.

        Example:
            >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # doctest: +SKIP
            >>> fully_shard(model, mesh=mesh["shard"])  # doctest: +SKIP
            >>> model.with_bagua([opt], DiLoCoAlgorithm(), device_mesh=mesh, replicate_dim="replicate")  # doctest: +SKIP
        """
        from bagua.torch_api.data_parallel.bagua_distributed import BaguaDistributedDataParallel

        if not comm.is_initialized():
            raise RuntimeError(
                "with_bagua() needs Bagua to be initialized first: call bagua.init_process_group() "
                "(import bagua.torch_api as bagua) before wrapping the model"
            )
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        if getattr(self, "bagua_ddp", None) is not None:
            self.bagua_ddp.close()
            self.bagua_ddp = None
        if getattr(self, "bagua_sharded", None) is not None:
            self.bagua_sharded.close()
            self.bagua_sharded = None
        if device_mesh is not None or replicate_dim is not None:
            return _with_sharded(self, optimizers, algorithm, process_group, device_mesh, replicate_dim)
        if any(hasattr(p, "device_mesh") for p in self.parameters()):
            raise ValueError("this model's parameters are DTensors (sharded with FSDP2 or tensor parallel): pass "
                             "device_mesh=mesh and replicate_dim=... to with_bagua so that Bagua runs between the "
                             "replicas and FSDP2 inside each")
        if not hasattr(self, "_bagua_module_name"):
            self._bagua_module_name = f"{type(self).__name__}_{id(self)}"
        self.bagua_ddp = BaguaDistributedDataParallel(
            self,
            optimizers,
            algorithm,
            process_group=process_group,
            bagua_module_name=self._bagua_module_name,
            gradient_as_bucket_view=do_flatten,
        )
        return self

    @contextlib.contextmanager
    def no_sync(self: torch.nn.Module) -> Iterator[None]:  # type: ignore[misc]
        """Accumulate gradients locally, without communication, inside the ``with`` block.

        Example:
            >>> with model.no_sync():  # doctest: +SKIP
            ...     loss_fn(model(x), y).backward()
        """
        ddp = getattr(self, "bagua_ddp", None)
        if ddp is None:
            raise RuntimeError("no_sync() needs a module wrapped with with_bagua(...)")
        with ddp.no_sync():
            yield

    @property
    def bagua_module_name(self: torch.nn.Module) -> str:  # type: ignore[misc]
        """The module's name in Bagua (class name and id unless set)."""
        if not hasattr(self, "_bagua_module_name"):
            self._bagua_module_name = f"{type(self).__name__}_{id(self)}"
        return self._bagua_module_name

    @bagua_module_name.setter
    def bagua_module_name(self: torch.nn.Module, name: str) -> None:  # type: ignore[misc]
        self._bagua_module_name = name

    @property
    def bagua_algorithm(self: torch.nn.Module) -> Optional[AlgorithmImpl]:  # type: ignore[misc]
        """The algorithm implementation the module trains with (``None`` before ``with_bagua``)."""
        ddp = _engine(self)
        return ddp.impl if ddp is not None else None

    def bagua_build_params(self: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:  # type: ignore[misc]
        """The parameters Bagua communicates, as ``(qualified name, parameter)`` (needs ``with_bagua`` first)."""
        ddp = _engine(self)
        if ddp is None:
            raise RuntimeError("bagua_build_params() needs a module wrapped with with_bagua(...)")
        return ddp.bagua_build_params()

    @property
    def bagua_optimizers(self: torch.nn.Module) -> list[torch.optim.Optimizer]:  # type: ignore[misc]
        """The optimizers given to ``with_bagua`` (empty before)."""
        ddp = _engine(self)
        return ddp.bagua_optimizers if ddp is not None else []

    @property
    def bagua_buckets(self: torch.nn.Module) -> list[BaguaBucket]:  # type: ignore[misc]
        """The module's buckets (empty before ``with_bagua``)."""
        ddp = _engine(self)
        return ddp.bagua_buckets if ddp is not None else []


def _engine(module: torch.nn.Module) -> "Optional[BaguaDistributedDataParallel]":
    # These properties live on every nn.Module, so they must not raise on modules that are not wrapped: tools
    # read every attribute in dir(module) (torch.compile does) and would fail on the first one that raises.
    return getattr(module, "bagua_ddp", None)


def _install() -> None:
    """Install :class:`BaguaModule`'s methods on ``torch.nn.Module`` and the original's tensor methods on
    ``torch.Tensor`` (the documented compatibility patch)."""
    for name in ("with_bagua", "no_sync", "bagua_module_name", "bagua_algorithm", "bagua_optimizers", "bagua_buckets",
                 "bagua_build_params"):
        if name == "no_sync" and hasattr(torch.nn.Module, "no_sync"):
            continue
        setattr(torch.nn.Module, name, BaguaModule.__dict__[name])
    for name in TENSOR_METHODS:
        setattr(torch.Tensor, name, TensorMethods.__dict__[name])


_install()


def _with_sharded(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], algorithm: Algorithm,
                  process_group: Optional[BaguaProcessGroup], device_mesh: Any,
                  replicate_dim: Optional[str]) -> torch.nn.Module:
    from bagua.torch_api.sharded import ShardedReplicas

    if device_mesh is None or replicate_dim is None:
        raise ValueError("with_bagua: pass both device_mesh= (a 2-D DeviceMesh) and replicate_dim= (the name of its "
                         "dimension Bagua communicates over)")
    if process_group is not None:
        raise ValueError("with_bagua: process_group= and device_mesh= exclude each other; the replicate dimension "
                         "of the mesh says which ranks Bagua communicates with")
    module.bagua_sharded = ShardedReplicas(module, list(optimizers), algorithm, device_mesh, replicate_dim)
    return module
