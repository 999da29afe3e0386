"""FedAsync's staleness-aware mixing (Xie et al. 2019)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..params import FlatParams
from ..schedules import get_schedule
from ._base import Arrival, MergeRule, RuleState, check_layout, describe_alpha, lerp

__all__ = ["Staleness"]


@dataclass
class Staleness(MergeRule):
    """FedAsync's staleness-aware mixing: the client's weight is ``(1 - alpha) * s(staleness)``.

    Parameters
    ----------
    alpha : float, "epoch" or callable, default 0.5
        As for :class:`~vcdask.merge.VCASGD`, for a fresh (staleness 0) update.
    function : {"polynomial", "hinge"}, default "polynomial"
        ``s(t) = (t + 1) ** -a``, or ``1`` for ``t <= b`` and ``1 / (a (t - b) + 1)`` after.
    a : float, default 0.5
    b : int, default 4
    """

    alpha: float | str | Callable[[int], float] = 0.5
    function: str = "polynomial"
    a: float = 0.5
    b: int = 4
    name: ClassVar[str] = "staleness"

    def __post_init__(self) -> None:
        self.schedule = get_schedule(self.alpha)
        if self.function not in ("polynomial", "hinge"):
            raise ValueError(f"function={self.function!r}: choose 'polynomial' or 'hinge'")
        if not (self.a >= 0 and math.isfinite(self.a)):
            raise ValueError(f"a={self.a!r}: must be a finite number >= 0")
        if self.b < 0:
            raise ValueError(f"b={self.b!r}: must be >= 0")

    def decay(self, staleness: int) -> float:
        """``s(staleness)``, in (0, 1]."""
        t = max(0, staleness)
        if self.function == "polynomial":
            return float((t + 1) ** -self.a)
        return 1.0 if t <= self.b else 1.0 / (self.a * (t - self.b) + 1.0)

    def apply(self, server: FlatParams, client: FlatParams, state: RuleState, arrival: Arrival) -> dict[str, Any]:
        check_layout(server, client)
        weight = (1.0 - float(self.schedule(arrival.epoch))) * self.decay(arrival.staleness)
        lerp(server, client, weight)
        return {"alpha": 1.0 - weight, "applied": True}

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "alpha": describe_alpha(self.schedule),
            "function": self.function,
            "a": self.a,
            "b": self.b,
        }
