"""Number and flag arguments, checked: :func:`positive_int`, :func:`is_real`, :func:`check_bool` (below every
module that checks an argument)."""

from __future__ import annotations

import numbers
from typing import Any, TypeGuard

import numpy as np

__all__ = ["check_bool", "is_real", "positive_int"]


def is_real(value: Any) -> TypeGuard[float]:
    """Whether ``value`` is a real number: an int, a float or a numpy scalar of either (``np.float32(0.1)``
    is no ``float``), but not a bool.  (Typed as a float guard: what the callers do with one, ``float(value)``
    and comparisons, an int and a numpy scalar support.)"""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def positive_int(name: str, value: Any, minimum: int = 1, *, also: str = "") -> int:
    """``value`` as an int >= ``minimum``; the error names the value (and ``also``, another choice).

    Raises
    ------
    TypeError
        Not an integer (``max_epochs='3'``, ``2.5``, ``True``); a string where ``also`` names a string
        choice is a ValueError.
    ValueError
        An integer below ``minimum``, or an unknown string choice.
    """
    message = f"{name} must be an integer >= {minimum}{f' or {also}' if also else ''}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise (ValueError if also and isinstance(value, str) else TypeError)(message)
    if value < minimum:
        raise ValueError(message)
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool: ``True`` or ``False`` (numpy's too), never a truthy string such as ``"no"``.

    Raises
    ------
    TypeError
        Naming the option and the value.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)
