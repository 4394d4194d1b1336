"""BaguaTensor: a named handle on the effective tensor of one parameter.

The original Bagua patched ``torch.Tensor`` with proxy methods; here a small object holds the parameter and
two closures instead: the *getter* returns the effective tensor (the gradient, the weight, or an optimizer
state) and the *setter* replaces it, which is how a bucket re-points it into its flat buffer.

Example:
    >>> p = torch.nn.Parameter(torch.ones(3))
    >>> t = BaguaTensor(p, "w", getter_closure=lambda p: p.grad, setter_closure=lambda p, g: setattr(p, "grad", g))
    >>> t.bagua_ensure_grad().bagua_getter_closure()
    tensor([0., 0., 0.])
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["BaguaTensor", "grad_tensor", "weight_tensor"]

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

    def bagua_set_storage(self, view: torch.Tensor) -> None:
        """Copy the effective tensor into ``view`` (same shape) and make ``view`` the effective tensor."""
        current = self.bagua_getter_closure()
        if current is not None and current.data_ptr() != view.data_ptr():
            view.copy_(current)
        elif current is None:
            view.zero_()
        self.bagua_setter_closure(view)

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
