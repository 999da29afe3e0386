"""The validation a run gets: :func:`hold_out` decides when ``fit`` holds out part of the training data, and
:func:`check_early_stopping` checks the early-stopping options against the metrics the run computes.

The one place for both: :func:`vcdask.options.plan` calls them for ``fit`` and ``vcdask train`` alike
(:class:`vcdask.Stopping` checks the types of the early-stopping options when it is made).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ._ints import positive_int

__all__ = ["HOLD_OUT", "check_early_stopping", "hold_out"]

logger = logging.getLogger(__name__)

#: The fraction of the training data held out when a run needs validation and none was given.
HOLD_OUT = 0.1


def hold_out(validation: Any, *, target: Any, patience: Any, monitor: Any) -> Any:
    """``validation`` as the run will use it: as given, or :data:`HOLD_OUT` of the training data when a
    ``target`` or early stopping (``patience``) needs validation and none was given.

    Raises
    ------
    ValueError, TypeError
        Early-stopping options of the wrong type (:func:`check_early_stopping`), or a ``monitor``
        of a run that gets no validation data (none given, no ``patience``, no ``target``).
    """
    if patience is not None or monitor is not None:
        check_early_stopping(patience, monitor, None, [monitor or "loss"], validated=False)  # types, before the data
        if validation is None and patience is None and target is None:
            raise ValueError(
                f"monitor={monitor!r} follows a validation metric, but this fit has no validation data: "
                "pass validation= (a fraction such as 0.2, or held-out data), patience= for early "
                "stopping or target= (either holds out 10% of the data by itself)"
            )
    if validation is not None:
        return validation
    if patience is not None:
        logger.info("early stopping without validation data: holding out 10%% of the training data")
        return HOLD_OUT
    if target is not None:
        logger.info("target given without validation data: holding out 10%% of the training data")
        return HOLD_OUT
    return None


def check_early_stopping(
    patience: Any, monitor: Any, target: dict[str, float] | None, metric_names: Sequence[str], validated: bool
) -> tuple[int | None, str | None]:
    """``patience`` and the metric it (and ``FitResult.best_version``) follows, checked.

    The default ``monitor``: the ``target``'s (first) metric, else the first metric that is not the
    loss, else the loss.  None without validation data (nothing to monitor).

    Raises
    ------
    ValueError, TypeError
        ``patience`` not a positive integer, or ``monitor`` not a computed metric (the valid ones listed).
    """
    if patience is not None:
        patience = positive_int("patience", patience)
    if monitor is not None and not isinstance(monitor, str):
        raise TypeError(f"monitor must be the name of a validation metric, got {type(monitor).__name__}")
    names = list(dict.fromkeys(["loss", *metric_names]))
    if monitor is not None and monitor not in names:
        raise ValueError(f"monitor={monitor!r} is not a validation metric of this run; available: {names}")
    if not validated:
        return patience, None
    if monitor is None:
        monitor = next(iter(target)) if target else next((n for n in names if n != "loss"), "loss")
    return patience, monitor
