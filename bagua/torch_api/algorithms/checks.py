"""Checks of algorithm hyper-parameters: a wrong type or a value outside the accepted set is a ``ValueError`` that
lists what is accepted, never a truthy string (``average="no"``) taken as ``True``.

Example:
    >>> check_bool("GradientAllReduceAlgorithm", "average", "no")
    Traceback (most recent call last):
    ...
    ValueError: GradientAllReduceAlgorithm(average=...) must be True or False, got 'no'
"""

from __future__ import annotations

import difflib
import numbers
from typing import Any, Sequence

__all__ = ["check_bool", "check_int", "check_number", "check_choice"]


def check_bool(owner: str, name: str, value: Any) -> None:
    """``value`` must be ``True`` or ``False`` (not ``"no"``, ``0`` or ``None``)."""
    if not isinstance(value, bool):
        raise ValueError(f"{owner}({name}=...) must be True or False, got {value!r}")


def check_int(owner: str, name: str, value: Any, minimum: int, meaning: str) -> None:
    """``value`` must be an integer (not a bool, a float or a string) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{owner}({name}=...) must be an integer >= {minimum} ({meaning}), got {value!r}")


def check_number(owner: str, name: str, value: Any, minimum: float, meaning: str) -> None:
    """``value`` must be a real number (not a bool or a string) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= minimum:
        raise ValueError(f"{owner}({name}=...) must be a number >= {minimum} ({meaning}), got {value!r}")


def check_choice(owner: str, name: str, value: Any, choices: Sequence[str]) -> None:
    """``value`` must be one of the strings ``choices``; the nearest one is suggested."""
    if not isinstance(value, str) or value not in choices:
        close = difflib.get_close_matches(value, choices, n=1) if isinstance(value, str) else []
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{owner}({name}={value!r}): choose one of {', '.join(repr(c) for c in choices)}.{hint}"
        )
