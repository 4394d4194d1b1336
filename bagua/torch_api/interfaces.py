"""The engine and the bucket as algorithms and bucket operations see them: small declared interfaces.

Imports run one way: the engine (``data_parallel``) imports the algorithms, and a bucket (``bucket.py``) imports
its operations (``ops/``, ``codecs/``). The layers below see the ones above only through these
:class:`typing.Protocol` s, the way a torch DDP communication hook sees a ``GradBucket`` and never the DDP object:
:class:`Engine` is what an :class:`~bagua.torch_api.algorithms.base.AlgorithmImpl` may ask of
``BaguaDistributedDataParallel``; :class:`Bucket` is what a bucket operation may ask of ``BaguaBucket``. Both real
classes satisfy them structurally (no registration, no inheritance); a test checks that they still do.

Example:
    >>> from bagua.torch_api.bucket import BaguaBucket
    >>> from bagua.torch_api.tensor import weight_tensor
    >>> isinstance(BaguaBucket([weight_tensor(torch.nn.Parameter(torch.ones(2)), "w")], name="0"), Bucket)
    True
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch

from bagua.torch_api.tensor import BaguaTensor

__all__ = ["Bucket", "Engine", "Job", "engine_of"]


@runtime_checkable
class Bucket(Protocol):
    """A bucket as its operations see it: ordered effective tensors of one dtype and, usually, one flat buffer.

    Fields: ``name`` (unique within a model), ``tensors``, ``flat`` (``None`` when not flattened), ``numel`` (the
    tensors' elements), ``padding`` (zeros after them in ``flat``), ``dtype``, ``device``.
    """

    name: str
    tensors: list[BaguaTensor]
    flat: Optional[torch.Tensor]
    numel: int
    padding: int
    dtype: torch.dtype
    device: torch.device

    def check_flatten(self) -> bool:
        """Return whether every effective tensor is still its view of ``flat``."""

    def flattened_tensor(self) -> torch.Tensor:
        """Return a new contiguous copy of the effective tensors (zero padding included)."""

    def has_pending(self) -> bool:
        """Return whether some fresh tensor still awaits its copy into ``flat``."""

    def pieces(self, start: int, end: int) -> list[torch.Tensor]:
        """Return the current values of the flat range ``[start, end)`` as 1-D pieces."""

    def materialize_pending(self) -> None:
        """Copy every fresh tensor into ``flat`` and make the views effective again."""


class Job(Protocol):
    """A function running on the engine's communication thread (:class:`bagua.torch_api.comm.worker.CommJob`)."""

    future: Future

    def done(self) -> bool:
        """Return whether the function has returned (or raised)."""

    def wait(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` seconds; raise if the function failed or is still running."""


@runtime_checkable
class Engine(Protocol):
    """The engine (``BaguaDistributedDataParallel``) as an algorithm's lifecycle methods see it.

    Fields: ``bagua_module_name`` (the wrapped model's name), ``bagua_optimizers``, ``bagua_buckets`` (as the
    algorithm's ``tensors_to_buckets`` made them), ``bagua_train_step_counter`` (training steps begun, counted at
    each forward), ``process_group`` (the engine's own group).
    """

    bagua_module_name: str
    bagua_optimizers: list[torch.optim.Optimizer]
    bagua_buckets: Sequence[Any]
    bagua_train_step_counter: int
    process_group: Any

    @property
    def bagua_tensors(self) -> list[BaguaTensor]:
        """The effective tensors, in the order the algorithm's ``init_tensors`` returned them."""

    def bagua_build_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Return ``(name, parameter)`` for every parameter to communicate, in registration order."""

    def mark_communication_ready(self, tensor: Any) -> None:
        """Mark one effective tensor (a name or a :class:`BaguaTensor`) ready; a complete bucket launches."""

    def mark_bucket_ready(self, bucket: Any) -> None:
        """Launch ``bucket``'s operations now, whatever its tensors' readiness."""

    def submit_job(self, fn: Callable[[], None], what: str, cuda: bool = False) -> Job:
        """Run ``fn`` on the engine's communication thread, after the bucket operations queued so far."""

    def launch_remaining_buckets(self) -> None:
        """Launch every bucket not launched yet in this step."""

    def wait_pending_comm_ops(self) -> None:
        """Wait for every launched bucket operation and communication job."""


def engine_of(obj: Any) -> Optional[Engine]:
    """Return the Bagua engine training ``obj``: a module wrapped with ``with_bagua``, Bagua's
    ``DistributedDataParallel``, or a wrapper holding either as ``.module``; ``None`` when there is none.

    Found by attributes (``bagua_ddp``, ``inner``), so layers below the engine can ask without importing it.

    Example:
        >>> engine_of(torch.nn.Linear(2, 2)) is None
        True
    """
    for m in (obj, getattr(obj, "module", None)):
        engine = getattr(m, "bagua_ddp", None) or getattr(m, "inner", None)
        if engine is not None and getattr(engine, "impl", None) is not None:
            return engine
    return None
