"""The paper's rule: ``W_s <- alpha * W_s + (1 - alpha) * W_c``, alpha constant or scheduled."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..params import FlatParams
from ..schedules import get_schedule
from ._base import Arrival, MergeRule, RuleState, check_layout, describe_alpha, lerp

__all__ = ["VCASGD", "vc_asgd"]


def vc_asgd(server: FlatParams, client: FlatParams, alpha: float) -> FlatParams:
    """Apply ``server <- alpha * server + (1 - alpha) * client`` in place and return ``server``.

    Applied with ``torch.lerp_`` (``W_s + (1 - alpha) * (W_c - W_s)``), one call per dtype vector.
    Integer and boolean state (e.g. BatchNorm's ``num_batches_tracked``) takes the client's value.

    Parameters
    ----------
    server : FlatParams
        The server parameters ``W_s``; modified in place.
    client : FlatParams
        The client's parameters ``W_c`` after training; not modified.
    alpha : float
        Weight of the server copy, in [0, 1].  ``alpha = 0`` replaces the server copy
        with the client's; ``alpha = 1`` ignores the client.

    Raises
    ------
    ParameterMismatchError
        The two layouts differ (names, shapes or dtypes).
    """
    check_layout(server, client)
    lerp(server, client, 1.0 - alpha)
    return server


@dataclass
class VCASGD(MergeRule):
    """The paper's rule: ``W_s <- alpha * W_s + (1 - alpha) * W_c``.

    Parameters
    ----------
    alpha : float, "epoch" or callable, default "epoch"
        The server copy's weight: a constant in [0, 1], ``"epoch"`` for ``e / (e + 1)``, or
        ``epoch -> alpha``.
    """

    alpha: float | str | Callable[[int], float] = "epoch"
    name: ClassVar[str] = "vc-asgd"

    def __post_init__(self) -> None:
        self.schedule = get_schedule(self.alpha)

    def apply(self, server: FlatParams, client: FlatParams, state: RuleState, arrival: Arrival) -> dict[str, Any]:
        alpha = float(self.schedule(arrival.epoch))
        vc_asgd(server, client, alpha)
        return {"alpha": alpha, "applied": True}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "alpha": describe_alpha(self.schedule)}
