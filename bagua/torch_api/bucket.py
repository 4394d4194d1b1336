"""BaguaBucket: ordered effective tensors of one dtype, one flat buffer, and a list of operations.

A bucket with ``flatten=True`` allocates its flat buffer once and makes every effective tensor a view of it, so
communication works on one large tensor with no copy (the equivalent of DDP's ``gradient_as_bucket_view``).
Its *operations* are :class:`~bagua.torch_api.ops.base.BucketOp` s, run in order as ``op(bucket, flat)`` on the
flat tensor when the bucket is executed; algorithms add them in ``init_operations`` (a plain callable
``fn(bucket, flat)`` is wrapped in a :class:`~bagua.torch_api.ops.base.FunctionOp`).

Example:
    >>> ts = [weight_tensor(torch.nn.Parameter(torch.ones(2)), f"p{i}") for i in range(2)]
    >>> bucket = BaguaBucket(ts, name="0", flatten=True)
    >>> bucket.flat
    tensor([1., 1., 1., 1.])
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence, Union

import torch

from bagua.torch_api import communication as comm
from bagua.torch_api.codecs.block import DEFAULT_BLOCK
from bagua.torch_api.codecs.registry import GlobalCodecRegistry
from bagua.torch_api.ops.allreduce import centralized_full_precision_op
from bagua.torch_api.ops.async_average import AsyncModelAverageOp
from bagua.torch_api.ops.base import AsyncHandle, BucketOp, FunctionOp
from bagua.torch_api.ops.compressed import centralized_low_precision_op
from bagua.torch_api.ops.decentralized import DecentralizedOp, LowPrecisionDecentralizedOp, Replicas, decentralized_op
from bagua.torch_api.comm.process_group import BaguaProcessGroup
from bagua.torch_api.tensor import BaguaTensor, as_bagua_tensor

__all__ = [
    "AsyncHandle",
    "BaguaBucket",
    "BucketOp",
    "split_bucket_by_bucket_size",
    "centralized_full_precision_op",
]

_FLAT_STORAGES: set[int] = set()  # storage addresses of the live buckets' flat buffers


def in_bucket_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in the flat buffer of a live Bagua bucket (``with_bagua(..., do_flatten=True)``).

    The fused optimizer leaves such memory where it is, as the original's did.
    """
    return t.layout == torch.strided and t.untyped_storage().data_ptr() in _FLAT_STORAGES


def split_bucket_by_bucket_size(tensors: Sequence[BaguaTensor], bucket_size: int) -> list[list[BaguaTensor]]:
    """Group ``tensors`` (kept in order) into buckets of about ``bucket_size`` bytes, one dtype per bucket.

    A bucket is closed once it reaches ``bucket_size``, so it can exceed it by one tensor. Dtypes are visited
    in a fixed order (by name) so that every rank builds the same buckets.
    """
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of bytes, got {bucket_size}")
    by_dtype: dict[str, list[BaguaTensor]] = {}
    for t in tensors:
        by_dtype.setdefault(str(t.dtype), []).append(t)
    buckets: list[list[BaguaTensor]] = []
    for dtype in sorted(by_dtype):
        current: list[BaguaTensor] = []
        size = 0
        for t in by_dtype[dtype]:
            current.append(t)
            size += t.numel() * t.param.element_size()
            if size >= bucket_size:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
    return buckets


class BaguaBucket:
    """A group of effective tensors communicated together.

    Args:
        tensors: the bucket's tensors (:class:`BaguaTensor` s, or tensors registered with
            ``ensure_bagua_tensor``), all of one floating dtype and device.
        name: the bucket's name (unique within a model).
        flatten: allocate one flat buffer and make every effective tensor a view of it.
        alignment: pad the flat buffer with zeros to a multiple of this many elements (e.g. the world size for
            algorithms that split the bucket into one chunk per rank).
    """

    #: fresh tensors smaller than this (elements) are copied into the flat buffer at once (see defer_restore)
    MIN_DEFERRED = 1 << 16

    def __init__(self, tensors: Sequence[BaguaTensor], name: str, flatten: bool = True, alignment: int = 1) -> None:
        if not tensors:
            raise ValueError(f"bucket {name!r} needs at least one tensor")
        tensors = [as_bagua_tensor(t) for t in tensors]
        if alignment < 1:
            raise ValueError(f"bucket alignment must be >= 1, got {alignment}")
        dtypes = {t.dtype for t in tensors}
        devices = {t.device for t in tensors}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"bucket {name!r} mixes dtypes {dtypes} / devices {devices}; split it per dtype")
        dtype = dtypes.pop()
        if not dtype.is_floating_point:
            bad = tensors[0].name
            raise ValueError(
                f"bucket {name!r}: tensor {bad!r} has dtype {dtype}; only floating-point tensors can be "
                "communicated. Exclude it with module._bagua_params_and_buffers_to_ignore or set requires_grad=False"
            )
        # user fields
        self.tensors: list[BaguaTensor] = list(tensors)
        self.name = name
        self.alignment = alignment
        self.dtype = dtype
        self.device = devices.pop()
        # internal state
        self.numel = sum(t.numel() for t in self.tensors)
        self.padding = (-self.numel) % alignment
        self._offsets: list[int] = []
        offset = 0
        for t in self.tensors:
            self._offsets.append(offset)
            offset += t.numel()
        self._ops: list[BucketOp] = []
        self.flat: Optional[torch.Tensor] = None
        self._buffer: Optional[torch.Tensor] = None
        # index -> a fresh effective tensor not yet copied into the flat buffer (see defer_restore)
        self._pending: dict[int, torch.Tensor] = {}
        # what the original's decentralized ops left on the bucket (its tests read them to check the maths):
        # the peer average (decentralized), the replicas x̂_i, x̂_l, x̂_r (low-precision decentralized)
        self._peer_weight: Optional[torch.Tensor] = None
        self._weight: Optional[torch.Tensor] = None
        self._left_peer_weight: Optional[torch.Tensor] = None
        self._right_peer_weight: Optional[torch.Tensor] = None
        if flatten:
            self._flatten_()

    # -- storage ---------------------------------------------------------------------------------------------

    def _flatten_(self) -> None:
        self.flat = torch.zeros(self.numel + self.padding, dtype=self.dtype, device=self.device)
        ptr = self.flat.untyped_storage().data_ptr()
        _FLAT_STORAGES.add(ptr)
        weakref.finalize(self.flat, _FLAT_STORAGES.discard, ptr)
        for t, off in zip(self.tensors, self._offsets):
            t.move_into(self.flat[off : off + t.numel()].view(t.shape))

    def view_of(self, index: int) -> torch.Tensor:
        """The slice of the flat buffer that belongs to tensor ``index``."""
        assert self.flat is not None
        t = self.tensors[index]
        off = self._offsets[index]
        return self.flat[off : off + t.numel()].view(t.shape)

    def check_flatten(self) -> bool:
        """Whether every effective tensor is still the view of the flat buffer it was given (or is a fresh tensor
        waiting to take its place, see :meth:`defer_restore`)."""
        if self.flat is None:
            return False
        for i, t in enumerate(self.tensors):
            eff = t.bagua_getter_closure()
            if eff is not None and eff is self._pending.get(i):
                continue
            if eff is None or eff.data_ptr() != self.view_of(i).data_ptr() or eff.shape != t.shape:
                return False
        return True

    def restore_view(self, index: int) -> None:
        """Make tensor ``index``'s effective tensor the flat buffer's view again, copying its current value in."""
        self._pending.pop(index, None)
        self.tensors[index].move_into(self.view_of(index))

    def accepts_pending(self) -> bool:
        """Whether the bucket's first operation reads fresh tensors in place (so they need no copy first)."""
        return self.flat is not None and bool(self._ops) and self._ops[0].accepts_pending

    def defer_restore(self, index: int, tensor: torch.Tensor) -> None:
        """Note that tensor ``index`` now lives in ``tensor`` (a fresh gradient, after ``zero_grad(set_to_none=True)``)
        instead of its view of the flat buffer, and leave the copy to the first operation.

        An operation whose ``accepts_pending`` is true reads such tensors through :meth:`pieces` and writes its
        result into the flat buffer; the views then become the effective tensors again without any copy. Any other
        operation sees the values copied into the flat buffer first. This saves a full copy of the bucket per step
        (about 8 ms for 64 MB on one CPU core).
        """
        if tensor.numel() < self.MIN_DEFERRED or not tensor.is_contiguous() or tensor.shape != self.tensors[index].shape:
            self.restore_view(index)  # small tensors are copied at once: cheaper than reading them piecewise
            return
        self._pending[index] = tensor

    def has_pending(self) -> bool:
        """Whether some tensor awaits its copy into the flat buffer."""
        return bool(self._pending)

    def pieces(self, start: int, end: int) -> list[torch.Tensor]:
        """The current values of the flat range ``[start, end)`` as 1-D pieces: the fresh tensors of
        :meth:`defer_restore` where there are some, the flat buffer (as few slices as possible) elsewhere."""
        assert self.flat is not None
        out: list[torch.Tensor] = []
        pos = start
        for off, src in sorted((self._offsets[i], t) for i, t in self._pending.items()):
            a, b = max(pos, off), min(end, off + src.numel())
            if a >= b:
                continue
            if a > pos:
                out.append(self.flat[pos:a])
            out.append(src.view(-1)[a - off : b - off])
            pos = b
        if pos < end:
            out.append(self.flat[pos:end])
        return out

    def materialize_pending(self) -> None:
        """Copy every fresh tensor into the flat buffer and make the views effective again."""
        for index in list(self._pending):
            self.restore_view(index)

    def adopt_pending(self) -> None:
        """Make the views effective again *without* copying (an operation has written them)."""
        for index in list(self._pending):
            del self._pending[index]
            self.tensors[index].bagua_setter_closure(self.view_of(index))

    def flattened_tensor(self) -> torch.Tensor:
        """A new contiguous copy of the bucket's effective tensors (zero padding included)."""
        out = torch.zeros(self.numel + self.padding, dtype=self.dtype, device=self.device)
        self._gather_into(out)
        return out

    def _gather_into(self, out: torch.Tensor) -> None:
        for t, off in zip(self.tensors, self._offsets):
            eff = t.bagua_getter_closure()
            if eff is None:
                out[off : off + t.numel()].zero_()
            else:
                out[off : off + t.numel()].copy_(eff.reshape(-1))

    def _scatter_from(self, src: torch.Tensor) -> None:
        for t, off in zip(self.tensors, self._offsets):
            t.effective().copy_(src[off : off + t.numel()].view(t.shape))

    def bytes(self) -> int:
        """Size of the bucket in bytes (padding included)."""
        return (self.numel + self.padding) * torch.empty((), dtype=self.dtype).element_size()

    # -- operations ------------------------------------------------------------------------------------------

    def clear_ops(self) -> "BaguaBucket":
        """Remove every operation; return the bucket."""
        self._ops.clear()
        return self

    def append_op(self, op: Union[BucketOp, Callable[["BaguaBucket", torch.Tensor], object]]) -> "BaguaBucket":
        """Append an operation (a :class:`BucketOp`, or a plain callable ``op(bucket, flat)``); return the bucket."""
        self._ops.append(op if isinstance(op, BucketOp) else FunctionOp(op))
        return self

    def append_python_op(self, python_function: Callable[[str], None],
                         group: Optional[BaguaProcessGroup] = None) -> "BaguaBucket":
        """Append ``python_function(bucket_name)``, run after the bucket's tensors are ready."""
        return self.append_op(FunctionOp(lambda bucket, flat: python_function(bucket.name)))

    @property
    def ops(self) -> tuple[BucketOp, ...]:
        """The bucket's operations, in the order they run."""
        return tuple(self._ops)

    def rollback(self) -> None:
        """Undo the state changes of the last execution of every operation (see :meth:`BucketOp.rollback`)."""
        for op in self._ops:
            op.rollback()

    def append_centralized_synchronous_op(
        self,
        hierarchical: bool = False,
        average: bool = True,
        scattergather: bool = False,
        compression: Optional[str] = None,
        group: Optional[BaguaProcessGroup] = None,
    ) -> "BaguaBucket":
        """Append an allreduce of the bucket over ``group`` (see :func:`centralized_full_precision_op`).

        ``compression`` names a gradient codec of the codec registry (:mod:`~bagua.torch_api.codecs.registry`):
        ``"MinMaxUInt8"`` (the original's name, an alias of ``"chunk"``) gives ByteGrad's 8-bit
        scatter-reduce-gather, ``"uint8"`` / ``"uint4"`` its block-wise codes (see
        :func:`~bagua.torch_api.ops.compressed.centralized_low_precision_op`).
        """
        group = group or comm._get_default_group()
        if compression is None:
            return self.append_op(centralized_full_precision_op(group, hierarchical, average, scattergather))
        try:
            codec = GlobalCodecRegistry.get(compression, for_gradients=True).name
        except ValueError:
            raise ValueError(f"unknown compression {compression!r}; available: None (float32), "
                             f"{GlobalCodecRegistry.listing(for_gradients=True, near=compression)}") from None
        return self.append_op(centralized_low_precision_op(group, hierarchical, average, codec=codec))

    # The original's decentralized appenders; their ops live in ops/decentralized.py and ops/async_average.py,
    # shared with the built-in algorithms (see docs/writing_algorithms.md).

    def append_decentralized_synchronous_op(
        self, peer_weight: torch.Tensor, hierarchical: bool = True, peer_selection_mode: str = "all",
        group: Optional[BaguaProcessGroup] = None,
    ) -> DecentralizedOp:
        """Append ``peer_weight = W(weights)`` (the peer average of decentralized SGD), ``peer_weight`` a flat tensor
        of the bucket's size, kept as ``bucket._peer_weight``. Returns the op; once it has run,
        ``op.copy_back_peer_weight(bucket)`` overwrites the weights with ``peer_weight``."""
        op = decentralized_op(group or comm._get_default_group(), peer_weight, hierarchical, peer_selection_mode)
        self._peer_weight = peer_weight
        self.append_op(op)
        return op

    def append_low_precision_decentralized_synchronous_op(
        self, weight: torch.Tensor, left_peer_weight: torch.Tensor, right_peer_weight: torch.Tensor,
        hierarchical: bool = True, compression: str = "MinMaxUInt8", group: Optional[BaguaProcessGroup] = None,
        block_size: int = DEFAULT_BLOCK,
    ) -> LowPrecisionDecentralizedOp:
        """Append one round of low-precision decentralized SGD on a ring; it ends with the weights equal to ``weight``.

        ``weight``, ``left_peer_weight``, ``right_peer_weight`` are the replicas x̂_i, x̂_l, x̂_r: flat float32
        tensors of the bucket's size, equal on every rank at the start, updated in place and kept as
        ``bucket._weight``, ``_left_peer_weight``, ``_right_peer_weight``. ``compression`` names the differences'
        codec in the codec registry (:mod:`~bagua.torch_api.codecs.registry`): ``"MinMaxUInt8"`` (the original's,
        alias of ``"chunk"``: one min/max for the whole bucket), or a block codec (``"bf16"``, ``"uint8"``,
        ``"uint4"``, ``"nf2"``, ``block_size`` elements per block). Returns the op.
        """
        try:
            codec = GlobalCodecRegistry.get(compression).name
        except ValueError:
            raise ValueError(f"unknown compression {compression!r}; available: "
                             f"{GlobalCodecRegistry.listing(near=compression)}") from None
        replicas = Replicas(weight, left_peer_weight, right_peer_weight, codec=codec, block_size=block_size)
        op = LowPrecisionDecentralizedOp(group or comm._get_default_group(), replicas, hierarchical)
        self._weight, self._left_peer_weight, self._right_peer_weight = weight, left_peer_weight, right_peer_weight
        self.append_op(op)
        return op

    def append_asynchronous_model_average_op(self, peer_selection_mode: str = "all",
                                             group: Optional[BaguaProcessGroup] = None) -> AsyncModelAverageOp:
        """Append one round of asynchronous model averaging, ``x += mean(s) - s`` for a snapshot ``s``, meant to be
        run from a thread of the algorithm. Returns the op, with ``lock_weight`` / ``unlock_weight`` (held by the
        training thread while the weights must not change), ``abort``, ``reset`` and ``get_status``."""
        op = AsyncModelAverageOp(group or comm._get_default_group(), peer_selection_mode)
        self.append_op(op)
        return op

    def async_launcher(self) -> Optional[Callable[["BaguaBucket", torch.Tensor], AsyncHandle]]:
        """The bucket's ``launch_async`` when its whole work is one collective on its flat buffer, else ``None``."""
        if self.flat is None or len(self._ops) != 1 or not self._ops[0].launches_async:
            return None
        return self._ops[0].launch_async

    def execute(self) -> None:
        """Run the bucket's operations on its flat tensor (gathering and scattering back when not flattened)."""
        if self.flat is not None and self.check_flatten():
            if self._pending and not self.accepts_pending():
                self.materialize_pending()
            for k, op in enumerate(self._ops):
                op(self, self.flat)
                if k == 0 and self._pending:
                    self.adopt_pending()
            return
        self._pending.clear()
        if self._buffer is None or self._buffer.numel() != self.numel + self.padding:
            self._buffer = torch.zeros(self.numel + self.padding, dtype=self.dtype, device=self.device)
        self._gather_into(self._buffer)
        for op in self._ops:
            op(self, self._buffer)
        self._scatter_from(self._buffer)

    def __repr__(self) -> str:
        return f"BaguaBucket(name={self.name!r}, tensors={len(self.tensors)}, numel={self.numel}, dtype={self.dtype})"
