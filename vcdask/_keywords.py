"""Keyword typos of :func:`vcdask.fit` (``epochs=``, ``learning_rate=``) refused with the keyword meant:
:func:`suggests_keywords`."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["suggests_keywords"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

#: Keywords of other libraries' training calls, and vcdask's for them (beside the close matches difflib finds).
_ALIASES = {
    "epochs": "max_epochs",
    "num_epochs": "max_epochs",
    "n_epochs": "max_epochs",
    "learning_rate": "lr",
    "criterion": "loss",
    "loss_fn": "loss",
    "validation_data": "validation",
    "validation_split": "validation",
}


def suggests_keywords(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` refusing a keyword it does not take with a ``TypeError`` that says which it meant (``epochs`` ->
    ``max_epochs``, :data:`_ALIASES`, else :func:`difflib.get_close_matches`); its signature kept for IDEs and
    type checkers (no ``**kwargs``: a typo is still flagged where it is written)."""
    names = [
        n for n, p in inspect.signature(fn).parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]

    @functools.wraps(fn)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            given = unknown[0]
            close = [_ALIASES[given]] if given in _ALIASES else difflib.get_close_matches(given, names, n=2)
            meant = f"; did you mean {' or '.join(f'{m}=' for m in close)}?" if close else ""
            raise TypeError(
                f"{fn.__name__}() got an unexpected keyword argument {given!r}{meant} (help(vcdask.{fn.__name__}) "
                "lists its options)"
            )
        return fn(*args, **kwargs)

    return checked
