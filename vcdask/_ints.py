"""Whole-number arguments, checked: :func:`positive_int` (below every module that checks an argument)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["positive_int"]


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
