"""``target=`` checked against the run's metrics, and a metric whose direction its name does not tell.

Called by :func:`vcdask.options.plan` (the pre-flight, once a run's metric names are known) and by
:class:`vcdask.Stopping` (the form alone).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._ints import is_real
from ._stack import user_level
from .engine.policy import known_direction
from .metrics import metric_bounds

__all__ = ["check_direction", "check_target"]


def check_target(
    target: Any, metric_names: Sequence[str] | None = None, metrics: Mapping[str, Callable] | None = None
) -> dict[str, float] | None:
    """``target`` as ``{metric: float}``; its names checked against ``metric_names`` (None: not known yet,
    the form alone is checked: :class:`vcdask.Stopping`), its goals against the ranges of vcdask's own metrics
    among ``metrics`` (the run's, name -> fn: :func:`vcdask.metrics.metric_bounds`).

    Raises
    ------
    TypeError
        Not a non-empty mapping.
    ValueError
        A metric the run does not compute (the valid ones named), a goal that is not a number, or one out of its
        metric's range, which the run could never reach (``{"accuracy": 95}``: a fraction, 0.95).

    Warns
    -----
    UserWarning
        With ``metric_names``: a metric whose direction its name does not tell (:func:`check_direction`).
    """
    if target is None:
        return None
    if not isinstance(target, Mapping) or not target:
        raise TypeError(f"target must be a mapping like {{'accuracy': 0.95}}, got {target!r}")
    valid = None if metric_names is None else ["loss", *metric_names]
    bounds = metric_bounds(metrics or {})
    for name, goal in target.items():
        if valid is not None and name not in valid:
            raise ValueError(f"target metric {name!r} is not computed; available: {valid}")
        if not is_real(goal) or math.isnan(goal):
            raise ValueError(f"target value for {name!r} must be a number, got {goal!r}")
        low, high = bounds.get(name, (-math.inf, math.inf))
        if not low <= goal <= high:
            percent = f" ({goal:g} looks like a percentage: {{{name!r}: {goal / 100:g}}})" if 1 < goal <= 100 else ""
            raise ValueError(
                f"target {{{name!r}: {goal:g}}} can never be reached: {name} lies in [{low:g}, {high:g}]{percent}"
            )
        if valid is not None:  # (the pre-flight's call, once a run's names are known: once per fit)
            check_direction(name, f"target {{{name!r}: {goal:g}}} is reached once {name} is at least {goal:g}")
    return {k: float(v) for k, v in target.items()}


def check_direction(name: str, means: str) -> None:
    """Warn that metric ``name`` (an ``eval_step``'s, or a function of ``metrics=``) is taken as improving upwards
    for want of a name whose direction vcdask knows (:func:`vcdask.engine.policy.known_direction`); ``means``:
    what that makes of the option that names it."""
    if not known_direction(name):
        warnings.warn(
            f"{means}: vcdask cannot tell from the name {name!r} which way it improves, and takes it as higher is "
            "better (for targets, early stopping and best_version). If lower is better, name it to end in 'loss' "
            f"or 'error' (e.g. {name + '_loss'!r}: the key your eval_step returns, or your metrics= dict's); if "
            f"higher is better, end it in 'score' ({name + '_score'!r}) to say so",
            UserWarning,
            stacklevel=user_level(),
        )
