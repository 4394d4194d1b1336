"""Plain data types shared with the original Bagua: tensor dtypes, tensor declarations, hyper-parameters.

Example:
    >>> hp = BaguaHyperparameter().update({"is_hierarchical_reduce": True})
    >>> hp.is_hierarchical_reduce
    True
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, TypedDict

__all__ = ["TensorDtype", "TensorDeclaration", "BaguaHyperparameter"]


class TensorDtype(str, enum.Enum):
    """Dtype names of the original's tensor declarations."""

    F32 = "f32"
    F16 = "f16"
    U8 = "u8"


class TensorDeclaration(TypedDict):
    """One tensor of a bucket: its ``name``, ``num_elements`` and ``dtype``."""

    name: str
    num_elements: int
    dtype: TensorDtype


@dataclasses.dataclass
class BaguaHyperparameter:
    """The tunable hyper-parameters of a wrapped model: bucket layout and hierarchical reduction.

    Args:
        buckets: a list of buckets, each a list of :class:`TensorDeclaration`.
        is_hierarchical_reduce: reduce inside nodes first, then among node leaders.
    """

    buckets: list[list[TensorDeclaration]] = dataclasses.field(default_factory=list)
    is_hierarchical_reduce: bool = False

    def update(self, param_dict: dict[str, Any]) -> "BaguaHyperparameter":
        """Set the fields named in ``param_dict``; return ``self``.

        Raises:
            ValueError: a key is not a field (the message lists the fields).
        """
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(param_dict) - fields)
        if unknown:
            raise ValueError(f"unknown hyper-parameter(s) {unknown}; available: {sorted(fields)}")
        for key, value in param_dict.items():
            setattr(self, key, value)
        return self

    def dict(self) -> dict[str, Any]:
        """The fields as a plain dict (the original's pydantic ``dict()``)."""
        return dataclasses.asdict(self)
