"""Synchronous large-batch merging (DeDLOC): one average per ``target_samples``, sample-weighted or robust."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .._ints import is_real
from ..params import FlatParams
from ._base import Arrival, MergeRule, RuleState, check_layout, floats, zeros_like

__all__ = ["AGGREGATES", "Sync"]

#: How :class:`Sync` combines a round's updates.
AGGREGATES = ("mean", "median", "trimmed-mean")


@dataclass
class Sync(MergeRule):
    """Synchronous large-batch merging (DeDLOC): collect updates until ``target_samples`` samples,
    then ``W_s <- sum(n_i W_c_i) / sum(n_i)`` at once; ``W_s`` is unchanged in between.

    Parameters
    ----------
    target_samples : int
        Samples per merge; :meth:`for_run` (so :func:`vcdask.fit`) defaults it to one epoch's rows.
    aggregate : {"mean", "median", "trimmed-mean"}, default "mean"
        How a round's updates are combined.  ``"mean"``: weighted by their samples.  The robust
        ones, for rounds that may hold a broken or hostile worker's update, combine each coordinate
        on its own and unweighted: ``"median"``, or ``"trimmed-mean"``, the mean of what is left
        once the ``trim`` share of the highest and of the lowest values is dropped.  They keep the
        round's updates (one parameter copy each) until the round closes, in the versioned rule
        state.
    trim : float, default 0.2
        ``"trimmed-mean"``: the share dropped at each end, in [0, 0.5).
    """

    target_samples: int | None = None
    aggregate: str = "mean"
    trim: float = 0.2
    name: ClassVar[str] = "sync"

    def __post_init__(self) -> None:
        if self.target_samples is not None and self.target_samples < 1:
            raise ValueError(f"target_samples={self.target_samples!r}: must be >= 1")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"unknown aggregate {self.aggregate!r}; valid aggregates: {list(AGGREGATES)}")
        if not is_real(self.trim) or not 0 <= self.trim < 0.5:
            raise ValueError(f"trim must be a number in [0, 0.5), got {self.trim!r}")

    def for_run(self, *, samples_per_epoch: int | None = None, in_flight: int | None = None) -> Sync:
        """This rule with ``target_samples`` set to one epoch's rows, if it was left to the run."""
        if self.target_samples is not None or samples_per_epoch is None:
            return self
        return Sync(target_samples=samples_per_epoch, aggregate=self.aggregate, trim=self.trim)

    def init_state(self, server: FlatParams) -> RuleState:
        if self.aggregate != "mean":  # the round's updates, "u0", "u1", ...
            return RuleState(scalars={"samples": 0, "updates": 0})
        return RuleState(arrays={"sum": zeros_like(server)}, scalars={"samples": 0, "updates": 0})

    def apply(self, server: FlatParams, client: FlatParams, state: RuleState, arrival: Arrival) -> dict[str, Any]:
        check_layout(server, client)
        if self.target_samples is None:
            raise ValueError("Sync needs target_samples (vcdask.fit sets it to one epoch's rows)")
        if self.aggregate != "mean":
            return self._robust(server, client, state, int(arrival.n_samples))
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

    def _robust(self, server: FlatParams, client: FlatParams, state: RuleState, n: int) -> dict[str, Any]:
        state.arrays[f"u{state.scalars['updates']}"] = client.clone()
        state.scalars["samples"] += n
        state.scalars["updates"] += 1
        if state.scalars["samples"] < self.target_samples:  # type: ignore[operator]
            return {"alpha": None, "applied": False}
        updates = [state.arrays.pop(f"u{i}") for i in range(state.scalars["updates"])]
        for dtype, ws in server.arrays.items():
            if not ws.is_floating_point():
                ws.copy_(updates[-1].arrays[dtype])
                continue
            stacked = torch.stack([u.arrays[dtype] for u in updates])
            ws.copy_(_combine(stacked, self.aggregate, self.trim).to(ws.dtype))
        state.scalars.update(samples=0, updates=0)
        return {"alpha": None, "applied": True}

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "target_samples": self.target_samples}
        if self.aggregate != "mean":
            out.update(aggregate=self.aggregate, trim=self.trim)
        return out


def _combine(stacked: torch.Tensor, aggregate: str, trim: float) -> torch.Tensor:
    """Coordinate-wise median or trimmed mean over the first dimension (one row per update)."""
    m = stacked.shape[0]
    ordered = stacked.float().sort(dim=0).values
    if aggregate == "median":  # of an even count: the mean of the middle two
        return ordered[(m - 1) // 2 : m // 2 + 1].mean(dim=0)
    k = int(trim * m)
    return ordered[k : m - k].mean(dim=0)
