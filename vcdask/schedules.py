"""Alpha schedules for the VC-ASGD merge ``W_s <- alpha * W_s + (1 - alpha) * W_c``.

A schedule maps the epoch of an update (1-based, as in the paper) to alpha in [0, 1].
Give :func:`get_schedule` a float (constant alpha), a name, or a callable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .errors import UnknownScheduleError

__all__ = ["SCHEDULES", "Constant", "EpochSchedule", "UnknownScheduleError", "get_schedule"]


def check_alpha(alpha: float, what: str = "alpha") -> float:
    """Return ``alpha`` as a float, or raise ValueError if it is NaN or outside [0, 1]."""
    try:
        value = float(alpha)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number in [0, 1], got {alpha!r}") from None
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{what} must be in [0, 1], got {alpha!r}")
    return value


@dataclass(frozen=True)
class Constant:
    """The same alpha for every update (the paper's 0.7 / 0.95 / 0.999 runs)."""

    alpha: float

    def __post_init__(self):
        check_alpha(self.alpha)

    def __call__(self, epoch: int) -> float:
        return self.alpha


@dataclass(frozen=True)
class EpochSchedule:
    """``alpha_e = e / (e + 1)`` for the 1-based epoch ``e``: 0.5, 0.67, 0.75, rising toward 1.

    The paper's "Var" run.
    """

    def __call__(self, epoch: int) -> float:
        return epoch / (epoch + 1)


#: Schedule names accepted by ``fit(alpha=...)``.
SCHEDULES: dict[str, Callable[[], Callable[[int], float]]] = {"epoch": EpochSchedule}


@dataclass(frozen=True)
class _Checked:
    """Wraps a user callable so a bad alpha is reported with the epoch that produced it."""

    fn: Callable[[int], float]

    def __call__(self, epoch: int) -> float:
        return check_alpha(self.fn(epoch), f"alpha schedule {self.fn!r} at epoch {epoch}")


def get_schedule(alpha: float | str | Callable[[int], float]) -> Callable[[int], float]:
    """Turn ``fit``'s ``alpha`` argument into a schedule ``epoch -> alpha``.

    Parameters
    ----------
    alpha : float, str or callable
        A constant in [0, 1]; a name from :data:`SCHEDULES` (``"epoch"``: e/(e+1));
        or a callable taking the 1-based epoch and returning alpha.

    Raises
    ------
    ValueError
        ``alpha`` is NaN or outside [0, 1].
    UnknownScheduleError
        Unknown name; the message lists the available ones.
    """
    if isinstance(alpha, bool):
        raise TypeError(f"alpha must be a number in [0, 1], a schedule name or a callable, got {alpha!r}")
    if isinstance(alpha, str):
        try:
            return SCHEDULES[alpha]()
        except KeyError:
            raise UnknownScheduleError(
                f"unknown alpha schedule {alpha!r}; available: {sorted(SCHEDULES)} "
                "(or a float in [0, 1], or a callable epoch -> alpha)"
            ) from None
    if isinstance(alpha, (Constant, EpochSchedule, _Checked)):
        return alpha
    if callable(alpha):
        return _Checked(alpha)
    return Constant(check_alpha(alpha))
