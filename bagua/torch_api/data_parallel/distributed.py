"""A drop-in for ``torch.nn.parallel.DistributedDataParallel`` that trains with a Bagua algorithm.

Example:
    >>> from bagua.torch_api.data_parallel import DistributedDataParallel as DDP
    >>> model = DDP(model, optimizers=[optimizer], algorithm=GradientAllReduceAlgorithm())  # doctest: +SKIP
    >>> with model.no_sync():  # gradient accumulation  # doctest: +SKIP
    ...     model(x).sum().backward()
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from bagua.torch_api import communication as comm
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.data_parallel.bagua_distributed import BaguaDistributedDataParallel
from bagua.torch_api.comm.process_group import BaguaProcessGroup

__all__ = ["DistributedDataParallel", "DistributedDataParallel_V1_9_0"]


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` like torch DDP, communicating with ``algorithm`` (gradient allreduce by default).

    Arguments of torch DDP that Bagua does not need are accepted: ``device_ids``/``output_device`` (the module
    must already be on its device), ``bucket_cap_mb`` (bucket size comes from ``BAGUA_DEFAULT_BUCKET_SIZE`` or
    autotune), ``broadcast_buffers`` (buffers are broadcast once, when wrapping), ``dim`` and
    ``check_reduction``.

    Args:
        module: the model.
        process_group: a :class:`BaguaProcessGroup`, a torch ``ProcessGroup``, or ``None`` for the default group.
        find_unused_parameters: give parameters unused on every rank a ``None`` gradient, as torch DDP does.
        gradient_as_bucket_view: gradients are views of the buckets' flat buffers (Bagua's ``do_flatten``).
        optimizers: the optimizers of ``module``.
        algorithm: the communication algorithm.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: Optional[Sequence[Union[int, torch.device]]] = None,
        output_device: Optional[Union[int, torch.device]] = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Union[BaguaProcessGroup, dist.ProcessGroup, None] = None,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        algorithm: Optional[Algorithm] = None,
    ) -> None:
        super().__init__()
        if not comm.is_initialized():
            raise RuntimeError("DistributedDataParallel needs bagua.init_process_group() to be called first")
        if dim != 0:
            warnings.warn("DistributedDataParallel: dim is ignored; Bagua does not scatter inputs", stacklevel=2)
        if algorithm is None:
            from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

            algorithm = GradientAllReduceAlgorithm()
        if isinstance(process_group, dist.ProcessGroup):
            process_group = comm.from_torch_group(process_group)
        self.module = module
        self.inner = BaguaDistributedDataParallel(
            module,
            list(optimizers),
            algorithm,
            process_group=process_group,
            bagua_module_name=getattr(module, "_bagua_module_name", None),
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, inside the ``with`` block."""
        with self.inner.no_sync():
            yield

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether backward communicates (False inside ``no_sync``)."""
        return self.inner.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.inner.require_backward_grad_sync = value

    @property
    def parameters_to_ignore(self) -> set:
        """Qualified names of parameters Bagua does not communicate."""
        return self.inner.parameters_to_ignore

    @property
    def bagua_algorithm(self) -> AlgorithmImpl:
        """The algorithm implementation."""
        return self.inner.impl

    @property
    def bagua_optimizers(self) -> list:
        """The optimizers."""
        return self.inner.bagua_optimizers

    @property
    def bagua_buckets(self) -> list[BaguaBucket]:
        """The buckets."""
        return self.inner.bagua_buckets

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("join() is not supported by Bagua; give every rank the same number of batches")

    def register_comm_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("register_comm_hook() is not supported; write a Bagua Algorithm instead")


#: The original's name of the class ``DistributedDataParallel(...)`` returned under torch 1.9+ (lightning-bagua imports
#: it as ``BaguaDistributedDataParallel``).
DistributedDataParallel_V1_9_0 = DistributedDataParallel
