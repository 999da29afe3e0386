"""Synchronous large-batch merging (DeDLOC): one average per ``target_samples``, sample-weighted or robust."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .._ints import is_real
from ..params import Entry, FlatParams, Layout, torch_dtype
from ._base import Arrival, MergeRule, RuleState, check_layout, floats, scratch

__all__ = ["AGGREGATES", "Sync"]

#: How :class:`Sync` combines a round's updates.
AGGREGATES = ("mean", "median", "trimmed-mean")
#: Half-precision parameters are summed and sorted in float32: a round's sum of ``n_i W_c_i`` overflowed
#: float16 (60 shards of 1000 rows of w = 1.5 made it inf), and its sum of ``n_i (W_c_i - W_s)`` may.
_WIDER = {"float16": "float32", "bfloat16": "float32"}


@dataclass
class Sync(MergeRule):
    """Synchronous large-batch merging (DeDLOC): collect updates until ``target_samples`` samples,
    then ``W_s <- sum(n_i W_c_i) / sum(n_i)`` at once; ``W_s`` is unchanged in between.

    The round sums what each update moved, ``n_i (W_c_i - W_s)``, and closes with
    ``W_s <- W_s + sum / sum(n_i)`` (the robust aggregates combine the moves too): a parameter no
    update moved (a frozen layer, a constant buffer) keeps its value exactly, where the average of
    its copies was a few ulps off it, and went on drifting round after round.

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
        state.  Half-precision parameters are summed (``"mean"``) or sorted in float32, and rounded
        to their dtype once, when the round closes; float64 ones stay float64.
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
        return RuleState(arrays={"moved": _zero_sum(server)}, scalars={"samples": 0, "updates": 0})

    def state_arrays(self, server: FlatParams, state: RuleState) -> set[str]:
        """``"moved"``, the round's sum of ``n_i (W_c_i - W_s)``; or the ``"sum"`` of ``n_i W_c_i`` that a
        vcdask before it saved (taken over at the next merge)."""
        if self.aggregate != "mean":
            return set()
        return {"sum"} if "sum" in state.arrays and "moved" not in state.arrays else {"moved"}

    def apply(self, server: FlatParams, client: FlatParams, state: RuleState, arrival: Arrival) -> dict[str, Any]:
        check_layout(server, client)
        if self.target_samples is None:
            raise ValueError("Sync needs target_samples (vcdask.fit sets it to one epoch's rows)")
        if self.aggregate != "mean":
            return self._robust(server, client, state, int(arrival.n_samples))
        sums = _sums(server, state)
        n = int(arrival.n_samples)
        for dtype, ws in floats(server).items():
            moved = scratch(state, f"moved.{dtype}", sums[dtype])  # W_c - W_s, in the sum's dtype
            moved.copy_(client.arrays[dtype]).sub_(ws)
            sums[dtype].add_(moved, alpha=n)
        for dtype, ws in server.arrays.items():
            if not ws.is_floating_point():
                sums[dtype].copy_(client.arrays[dtype])
        state.scalars["samples"] += n
        state.scalars["updates"] += 1
        if state.scalars["samples"] < self.target_samples:
            return {"alpha": None, "applied": False}
        for dtype, ws in server.arrays.items():
            acc = sums[dtype]
            if ws.is_floating_point():  # (a float32 sum of half precision: W_s + mean rounded here, once)
                ws.copy_(acc.div_(state.scalars["samples"]).add_(ws))
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
            moved = torch.stack([u.arrays[dtype] for u in updates])
            if moved.dtype in (torch.float16, torch.bfloat16):
                moved = moved.float()
            moved.sub_(ws)  # W_c_i - W_s
            ws.copy_(_combine(moved, self.aggregate, self.trim).add_(ws))
        state.scalars.update(samples=0, updates=0)
        return {"alpha": None, "applied": True}

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "target_samples": self.target_samples}
        if self.aggregate != "mean":
            out.update(aggregate=self.aggregate, trim=self.trim)
        return out


def _sum_places(sizes: dict[str, int]) -> dict[str, tuple[str, int]]:
    """Where the round's sum of each dtype's array lives: the sum's dtype (see :data:`_WIDER`) and the
    array's start in that dtype's flat vector (a dtype summed as itself first, the half-precision ones after it)."""
    ends: dict[str, int] = {}
    places = {}
    for dtype in sorted(sizes, key=lambda d: d in _WIDER):
        into = _WIDER.get(dtype, dtype)
        places[dtype] = (into, ends.get(into, 0))
        ends[into] = places[dtype][1] + sizes[dtype]
    return places


def _sum_layout(layout: Layout) -> Layout:
    """The layout of the ``"moved"`` state: the parameters' own, but with half-precision entries in float32
    (behind the float32 ones, where the model has both)."""
    places = _sum_places(layout.sizes)
    if all(into == dtype for dtype, (into, _) in places.items()):
        return layout
    return Layout(
        tuple(Entry(e.name, e.shape, places[e.dtype][0], places[e.dtype][1] + e.offset) for e in layout.entries)
    )


def _zero_sum(server: FlatParams) -> FlatParams:
    """A zero ``"moved"`` state for ``server`` (laid out by :func:`_sum_layout`)."""
    layout = _sum_layout(server.layout)
    return FlatParams(layout, {d: torch.zeros(n, dtype=torch_dtype(d)) for d, n in layout.sizes.items()})


def _sums(server: FlatParams, state: RuleState) -> dict[str, torch.Tensor]:
    """The round's running sum of ``n_i (W_c_i - W_s)`` of each of the parameters' dtypes: views into the
    ``"moved"`` state (integer dtypes: the last update's values).

    The ``"sum"`` of ``n_i W_c_i`` an earlier vcdask saved (``W_s`` has not changed since the round began)
    becomes ``"moved"``: less ``sum(n_i) W_s``; one it kept in half precision (the parameters' layout) is
    taken up to float32 first (exactly).
    """
    places = _sum_places(server.layout.sizes)
    total = state.arrays.get("moved")
    if total is None:
        old = state.arrays.pop("sum")
        total = state.arrays["moved"] = _zero_sum(server)
        as_params = any(d in _WIDER for d in old.arrays)  # (else laid out as "moved" is)
        for dtype, (into, start) in places.items():
            n = server.arrays[dtype].numel()
            view = total.arrays[into][start : start + n]
            view.copy_(old.arrays[dtype] if as_params else old.arrays[into][start : start + n])
            if view.is_floating_point():
                view.sub_(server.arrays[dtype].to(view.dtype), alpha=state.scalars["samples"])
    return {
        dtype: total.arrays[into][start : start + server.arrays[dtype].numel()]
        for dtype, (into, start) in places.items()
    }


def _combine(stacked: torch.Tensor, aggregate: str, trim: float) -> torch.Tensor:
    """Coordinate-wise median or trimmed mean over the first dimension (one row per update), in
    ``stacked``'s dtype (the caller's: half precision taken up to float32, float64 kept)."""
    m = stacked.shape[0]
    ordered = stacked.sort(dim=0).values
    if aggregate == "median":  # of an even count: the mean of the middle two
        return ordered[(m - 1) // 2 : m // 2 + 1].mean(dim=0)
    k = int(trim * m)
    return ordered[k : m - k].mean(dim=0)
