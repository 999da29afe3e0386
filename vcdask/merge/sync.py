"""Synchronous large-batch merging (DeDLOC): one sample-weighted average per ``target_samples``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..params import FlatParams
from ._base import Arrival, MergeRule, RuleState, check_layout, floats, zeros_like

__all__ = ["Sync"]


@dataclass
class Sync(MergeRule):
    """Synchronous large-batch merging (DeDLOC): collect updates until ``target_samples`` samples,
    then ``W_s <- sum(n_i W_c_i) / sum(n_i)`` at once; ``W_s`` is unchanged in between.

    Parameters
    ----------
    target_samples : int
        Samples per merge; :meth:`for_run` (so :func:`vcdask.fit`) defaults it to one epoch's rows.
    """

    target_samples: int | None = None
    name: ClassVar[str] = "sync"

    def __post_init__(self) -> None:
        if self.target_samples is not None and self.target_samples < 1:
            raise ValueError(f"target_samples={self.target_samples!r}: must be >= 1")

    def for_run(self, *, samples_per_epoch: int | None = None, in_flight: int | None = None) -> Sync:
        """This rule with ``target_samples`` set to one epoch's rows, if it was left to the run."""
        if self.target_samples is not None or samples_per_epoch is None:
            return self
        return Sync(target_samples=samples_per_epoch)

    def init_state(self, server: FlatParams) -> RuleState:
        return RuleState(arrays={"sum": zeros_like(server)}, scalars={"samples": 0, "updates": 0})

    def apply(self, server: FlatParams, client: FlatParams, state: RuleState, arrival: Arrival) -> dict[str, Any]:
        check_layout(server, client)
        if self.target_samples is None:
            raise ValueError("Sync needs target_samples (vcdask.fit sets it to one epoch's rows)")
        total = state.arrays["sum"]
        n = int(arrival.n_samples)
        for dtype in floats(server):
            total.arrays[dtype].add_(client.arrays[dtype], alpha=n)
        for dtype, ws in server.arrays.items():
            if not ws.is_floating_point():
                total.arrays[dtype].copy_(client.arrays[dtype])
        state.scalars["samples"] += n
        state.scalars["updates"] += 1
        if state.scalars["samples"] < self.target_samples:
            return {"alpha": None, "applied": False}
        for dtype, ws in server.arrays.items():
            acc = total.arrays[dtype]
            if ws.is_floating_point():
                ws.copy_(acc / state.scalars["samples"])
                acc.zero_()
            else:
                ws.copy_(acc)
        state.scalars.update(samples=0, updates=0)
        return {"alpha": None, "applied": True}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "target_samples": self.target_samples}
