"""BaguaTensor: a named handle on the effective tensor of one parameter, and the original's tensor API.

A small object holds the parameter and two closures: the *getter* returns the effective tensor (the gradient,
the weight, or an optimizer state) and the *setter* replaces it, which is how a bucket re-points it into its flat
buffer. The engine works on these objects only.

The original Bagua instead called methods on ``torch.Tensor`` itself (``param.bagua_ensure_grad()
.ensure_bagua_tensor(name, module_name, getter_closure=..., setter_closure=...)``, ``bagua_getter_closure()``,
``bagua_mark_communication_ready()``, ...), and user-written algorithms still do. :class:`TensorMethods` holds
those methods; ``bagua.torch_api.distributed`` installs them on ``torch.Tensor`` once, in the same place and for
the same reason as ``nn.Module.with_bagua`` (see docs/writing_algorithms.md). ``ensure_bagua_tensor`` attaches a
:class:`BaguaTensor` to the tensor (``tensor.bagua_backend_tensor()``); the engine accepts either.

Example:
    >>> p = torch.nn.Parameter(torch.ones(3))
    >>> t = BaguaTensor(p, "w", getter_closure=lambda p: p.grad, setter_closure=lambda p, g: setattr(p, "grad", g))
    >>> t.bagua_ensure_grad().bagua_getter_closure()
    tensor([0., 0., 0.])
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Union

import torch

__all__ = ["BaguaTensor", "TensorMethods", "as_bagua_tensor", "grad_tensor", "weight_tensor"]

Getter = Callable[[torch.Tensor], Optional[torch.Tensor]]
Setter = Callable[[torch.Tensor, torch.Tensor], None]


def _get_data(p: torch.Tensor) -> torch.Tensor:
    return p.data


def _set_data(p: torch.Tensor, t: torch.Tensor) -> None:
    p.data = t


def _get_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    return p.grad


def _set_grad(p: torch.Tensor, t: torch.Tensor) -> None:
    p.grad = t


class BaguaTensor:
    """The effective tensor of ``param`` under a unique ``name``.

    Args:
        param: the parameter (or any tensor) the effective tensor belongs to.
        name: unique name, usually the parameter's qualified name.
        module_name: name of the wrapped module (``BaguaModule.bagua_module_name``).
        getter_closure: ``param -> effective tensor``; default: the parameter's data.
        setter_closure: ``(param, tensor) -> None`` replacing the effective tensor; default: sets ``.data``.
    """

    __slots__ = ("param", "name", "module_name", "_getter", "_setter")

    def __init__(
        self,
        param: torch.Tensor,
        name: str,
        module_name: Optional[str] = None,
        getter_closure: Optional[Getter] = None,
        setter_closure: Optional[Setter] = None,
    ) -> None:
        self.param = param
        self.name = name
        self.module_name = module_name
        self._getter = getter_closure or _get_data
        self._setter = setter_closure or _set_data

    def bagua_getter_closure(self) -> Optional[torch.Tensor]:
        """Return the effective tensor (``None`` for a gradient not yet created)."""
        return self._getter(self.param)

    def bagua_setter_closure(self, tensor: torch.Tensor) -> None:
        """Replace the effective tensor with ``tensor``."""
        self._setter(self.param, tensor)

    def bagua_ensure_grad(self) -> "BaguaTensor":
        """Create a zero gradient on the parameter if it has none; return ``self``."""
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param, memory_format=torch.contiguous_format)
        return self

    def effective(self) -> torch.Tensor:
        """The effective tensor, creating a zero one first when it does not exist yet (gradients)."""
        t = self.bagua_getter_closure()
        if t is None:
            t = torch.zeros_like(self.param, memory_format=torch.contiguous_format)
            self.bagua_setter_closure(t)
        return t

    def move_into(self, view: torch.Tensor) -> None:
        """Copy the effective tensor into ``view`` (same shape) and make ``view`` the effective tensor."""
        current = self.bagua_getter_closure()
        if current is not None and current.data_ptr() != view.data_ptr():
            view.copy_(current)
        elif current is None:
            view.zero_()
        self.bagua_setter_closure(view)

    def bagua_set_storage(self, storage: "Union[torch.UntypedStorage, torch.TypedStorage, torch.Tensor]",
                          storage_offset: int = 0) -> None:
        """Make the effective tensor live in ``storage`` from element ``storage_offset`` on (the original's
        meaning: no copy, the effective tensor then reads what the storage holds).

        Args:
            storage: a storage, or a tensor whose storage to use.
            storage_offset: offset in elements of the effective tensor's dtype.
        """
        if isinstance(storage, torch.Tensor):
            storage = storage.untyped_storage()
        elif isinstance(storage, torch.TypedStorage):
            storage = storage.untyped_storage
        with torch.no_grad():
            view = torch.empty(0, dtype=self.dtype, device=self.device).set_(storage, storage_offset, self.shape)
        self.bagua_setter_closure(view)

    def is_bagua_tensor(self) -> bool:
        """True (the original's check, for code that holds either kind)."""
        return True

    def bagua_backend_tensor(self) -> "BaguaTensor":
        """This object (the original's backend tensor)."""
        return self

    def bagua_mark_communication_ready(self) -> None:
        """Mark this tensor ready on the engine of its module; a bucket whose tensors are all ready is launched.

        On CUDA the engine orders the bucket's communication after the current stream's work, as the original's
        ready event did.
        """
        engine = _engines.get(self.module_name) if self.module_name is not None else None
        if engine is None:
            raise RuntimeError(
                f"tensor {self.name!r}: no wrapped module named {self.module_name!r}; register it with "
                "ensure_bagua_tensor(name, module_name=model.bagua_module_name) after with_bagua(...)"
            )
        engine.mark_communication_ready(self.name)

    def bagua_mark_communication_ready_without_synchronization(self) -> None:
        """Same as :meth:`bagua_mark_communication_ready` (the engine records no per-tensor events)."""
        self.bagua_mark_communication_ready()

    def numel(self) -> int:
        """Number of elements of the effective tensor."""
        return self.param.numel()

    @property
    def shape(self) -> torch.Size:
        """Shape of the effective tensor."""
        return self.param.shape

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the effective tensor."""
        t = self.bagua_getter_closure()
        return (t if t is not None else self.param).dtype

    @property
    def device(self) -> torch.device:
        """Device of the effective tensor."""
        return self.param.device

    def __repr__(self) -> str:
        return f"BaguaTensor(name={self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def grad_tensor(param: torch.Tensor, name: str, module_name: Optional[str] = None) -> BaguaTensor:
    """A :class:`BaguaTensor` whose effective tensor is ``param.grad``."""
    return BaguaTensor(param, name, module_name, _get_grad, _set_grad)


def weight_tensor(param: torch.Tensor, name: str, module_name: Optional[str] = None) -> BaguaTensor:
    """A :class:`BaguaTensor` whose effective tensor is the parameter's data."""
    return BaguaTensor(param, name, module_name, _get_data, _set_data)


def as_bagua_tensor(tensor: "Union[BaguaTensor, torch.Tensor]") -> BaguaTensor:
    """The :class:`BaguaTensor` of ``tensor``: itself, or the one ``tensor.ensure_bagua_tensor(...)`` attached."""
    if isinstance(tensor, BaguaTensor):
        return tensor
    proxy = getattr(tensor, "_bagua_tensor", None) if isinstance(tensor, torch.Tensor) else None
    if proxy is None:
        raise TypeError(
            f"expected a BaguaTensor or a tensor registered with tensor.ensure_bagua_tensor(name, module_name), "
            f"got {type(tensor).__name__}; call ensure_bagua_tensor on it first"
        )
    return proxy


# module name -> the engine training that module, for Tensor.bagua_mark_communication_ready (filled by the engine)
_engines: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def bind_engine(module_name: str, engine: Any) -> None:
    """Let tensors registered with ``module_name`` mark themselves ready on ``engine`` (called by the engine)."""
    _engines[module_name] = engine


class TensorMethods:
    """The original's methods on ``torch.Tensor``; ``import bagua.torch_api`` installs them (see module doc).

    Example:
        >>> p = torch.nn.Parameter(torch.ones(3))
        >>> p.bagua_ensure_grad().ensure_bagua_tensor("w", getter_closure=lambda p: p.grad,
        ...     setter_closure=lambda p, t: setattr(p, "grad", t)).bagua_getter_closure()
        tensor([0., 0., 0.])
    """

    def is_bagua_tensor(self: torch.Tensor) -> bool:
        """Whether ``ensure_bagua_tensor`` registered this tensor."""
        return getattr(self, "_bagua_tensor", None) is not None

    def ensure_bagua_tensor(
        self: torch.Tensor, name: Optional[str] = None, module_name: Optional[str] = None,
        getter_closure: Optional[Getter] = None, setter_closure: Optional[Setter] = None,
    ) -> torch.Tensor:
        """Register this tensor in place as a Bagua tensor and return it.

        Args:
            name: unique name (a parameter's qualified name, as ``bagua_build_params()`` gives it).
            module_name: ``model.bagua_module_name``; needed by ``bagua_mark_communication_ready``.
            getter_closure: ``tensor -> effective tensor`` (e.g. ``lambda p: p.grad``); default: the tensor itself.
            setter_closure: ``(tensor, new) -> None`` replacing the effective tensor; needs ``getter_closure``.

        Returns:
            This tensor.
        """
        if setter_closure is not None and getter_closure is None:
            raise ValueError("ensure_bagua_tensor: a setter_closure needs its getter_closure")
        old = getattr(self, "_bagua_tensor", None)
        if old is not None and name is not None and old.name != name:
            raise ValueError(f"tensor is already the Bagua tensor {old.name!r}; it cannot be renamed {name!r}")
        if old is not None and module_name is not None and old.module_name not in (None, module_name):
            raise ValueError(f"tensor {old.name!r} belongs to module {old.module_name!r}, not {module_name!r}")
        name = name if name is not None else (old.name if old is not None else "")
        module_name = module_name if module_name is not None else (old.module_name if old is not None else None)
        self._bagua_tensor = BaguaTensor(self, name, module_name, getter_closure, setter_closure)
        self.bagua_tensor_name = name
        self.bagua_module_name = module_name
        return self

    def to_bagua_tensor(
        self: torch.Tensor, name: Optional[str] = None, module_name: Optional[str] = None,
        getter_closure: Optional[Getter] = None, setter_closure: Optional[Setter] = None,
    ) -> torch.Tensor:
        """Return a new tensor sharing this tensor's storage (``detach()``), registered as a Bagua tensor; this
        tensor is left as it is. The closures receive the new tensor."""
        return TensorMethods.ensure_bagua_tensor(self.detach(), name, module_name, getter_closure, setter_closure)

    def bagua_backend_tensor(self: torch.Tensor) -> BaguaTensor:
        """The :class:`BaguaTensor` the engine works on (the original returned its Rust tensor here)."""
        return as_bagua_tensor(self)

    def bagua_ensure_grad(self: torch.Tensor) -> torch.Tensor:
        """Create a zero gradient if there is none; return this tensor (a leaf that requires grad)."""
        if not (self.is_leaf and self.requires_grad):
            raise ValueError("bagua_ensure_grad() needs a leaf tensor that requires grad, such as a Parameter")
        if self.grad is None:
            with torch.no_grad():
                self.grad = torch.zeros_like(self, memory_format=torch.contiguous_format)
        return self

    def bagua_getter_closure(self: torch.Tensor) -> Optional[torch.Tensor]:
        """The effective tensor (the tensor itself unless a getter was given)."""
        return as_bagua_tensor(self).bagua_getter_closure()

    def bagua_setter_closure(self: torch.Tensor, tensor: torch.Tensor) -> None:
        """Replace the effective tensor with ``tensor``."""
        as_bagua_tensor(self).bagua_setter_closure(tensor)

    def bagua_set_storage(
        self: torch.Tensor, storage: "Union[torch.UntypedStorage, torch.TypedStorage, torch.Tensor]",
        storage_offset: int = 0,
    ) -> None:
        """Make the effective tensor live in ``storage`` from element ``storage_offset`` on (no copy)."""
        as_bagua_tensor(self).bagua_set_storage(storage, storage_offset)

    def bagua_mark_communication_ready(self: torch.Tensor) -> None:
        """Mark this tensor ready on the engine of its module (see :meth:`BaguaTensor.bagua_mark_communication_ready`)."""
        as_bagua_tensor(self).bagua_mark_communication_ready()

    def bagua_mark_communication_ready_without_synchronization(self: torch.Tensor) -> None:
        """Same as :meth:`bagua_mark_communication_ready` (the engine records no per-tensor events)."""
        as_bagua_tensor(self).bagua_mark_communication_ready()


#: the names :func:`bagua.torch_api.distributed._install` puts on ``torch.Tensor``
TENSOR_METHODS = tuple(name for name in vars(TensorMethods) if not name.startswith("_"))
