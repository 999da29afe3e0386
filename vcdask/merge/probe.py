"""The outer step sized per merge by a probe of the training loss (issue 38)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .._ints import is_real
from ..params import FlatParams
from ._base import (
    Arrival,
    MergeRule,
    RuleState,
    buffer_weight,
    check_layout,
    copy_non_float,
    float_buffers,
    floats,
    scratch,
    zero_buffers,
    zeros_like,
)

__all__ = ["Probe"]


def _grid(name: str, values: Sequence[float], low: float, high: float, high_open: bool = False) -> tuple[float, ...]:
    """``values`` as a tuple of floats, each finite and in ``[low, high]`` (``[low, high)``), or a ValueError."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{name}={values!r}: give a non-empty sequence of numbers")
    out = []
    for v in values:
        if not is_real(v) or not math.isfinite(v):
            raise ValueError(f"{name}={values!r}: {v!r} is not a finite number")
        if v < low or v > high or (high_open and v == high):
            bound = f"[{low:g}, {high:g}{')' if high_open else ']'}"
            raise ValueError(f"{name}={values!r}: {v!r} is outside {bound}")
        out.append(float(v))
    return tuple(out)


@dataclass
class Probe(MergeRule):
    """Each merge picks its own step: the candidate ``W_s`` with the lowest training loss on a few rows.

    An update ``W_c`` trained from a base version ``W_base`` that is ``s`` merges old splits into the
    task's own progress ``p = W_c - W_base`` and the pull back toward its stale base ``W_base - W_s``.
    The merge moves

    ``d = (a * p + b * (W_base - W_s)) / (s + 1)``

    with ``a`` from :attr:`steps` and ``b`` from :attr:`pulls` chosen by the loss of each candidate
    ``W_s + d`` (``arrival.loss``: vcdask's parameter server gives the training loss on a fixed sample of
    the training rows, the first rows of every shard).  The search goes one coordinate at a time: ``a``
    with ``b = 1``, then ``b`` (a fresh update, ``s = 0``, has no pull-back: ``a`` only).  ``a = b = 1``
    is FedAsync's ``1 / (s + 1)`` mixing; the probe lengthens the step where the task's progress points
    downhill and pulls less toward a stale base where the server has since moved on.

    Then heavy-ball momentum on the applied moves is probed: ``m <- d + mu * m``, ``W_s <- W_s + m``, with
    ``mu`` from :attr:`momenta` (the state's ``momentum``; ``momenta=(0,)``: none).

    Float buffers (BatchNorm's running statistics: the layout's ``buffers``) take neither ``a``, ``b``
    nor the momentum, which would carry a falling running variance below zero: every candidate, and
    the merge, has them at ``a = b = 1``'s (FedAsync's ``1 / (s + 1)`` of the client's), with no
    momentum on them.

    Costs ``len(steps) + len(momenta) - 1`` forward passes over the probe's :attr:`rows` for a fresh
    update (7 with the defaults), and ``len(pulls) - 1`` more for a stale one (9), on the scheduler's CPU,
    in the merge thread.  Every merge probes: merges that took the last choice instead (every 4th probing, or those
    with results queued behind them) lost 2-14 points on digits at 4-8 workers.  Measured in
    ``benchmarks/fleet_sim.py`` and ``benchmarks/equal_tokens.py``; see the docs' merge-rules page.

    Parameters
    ----------
    steps : sequence of float, default (0.5, 1, 1.5, 2, 3)
        Candidate weights ``a`` of the task's own progress, each in ``[0, 10]``.
    pulls : sequence of float, default (0, 0.5, 1)
        Candidate weights ``b`` of the pull back toward the update's base, each in ``[0, 2]``.
    momenta : sequence of float, default (0, 0.5, 0.9)
        Candidate momenta ``mu``, each in ``[0, 1)``; ``(0,)``: none (no momentum, no state).
    rows : int, default 64
        Training rows the server scores each candidate on (the first ``rows / n_shards`` of every shard).
    """

    steps: Sequence[float] = (0.5, 1.0, 1.5, 2.0, 3.0)
    pulls: Sequence[float] = (0.0, 0.5, 1.0)
    momenta: Sequence[float] = (0.0, 0.5, 0.9)
    rows: int = 64
    name: ClassVar[str] = "probe"
    needs: ClassVar[frozenset[str]] = frozenset({"base", "loss"})

    def __post_init__(self) -> None:
        self.steps = _grid("steps", self.steps, 0.0, 10.0)
        self.pulls = _grid("pulls", self.pulls, 0.0, 2.0)
        self.momenta = _grid("momenta", self.momenta, 0.0, 1.0, high_open=True)
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1:
            raise ValueError(f"rows={self.rows!r}: must be an integer >= 1")

    @property
    def passes(self) -> int:
        """The most forward passes a merge takes (a stale update's, with momentum to probe)."""
        return len(self.steps) + len(self.pulls) - 1 + len(self.momenta) - 1

    @property
    def with_momentum(self) -> bool:
        return any(mu != 0.0 for mu in self.momenta)

    def init_state(self, server: FlatParams) -> RuleState:
        return RuleState(arrays={"momentum": zeros_like(server)}) if self.with_momentum else RuleState()

    def apply(self, server: FlatParams, client: FlatParams, state: RuleState, arrival: Arrival) -> dict[str, Any]:
        check_layout(server, client)
        base, loss = arrival.base, arrival.loss
        if base is None or loss is None:
            raise ValueError(
                "the 'probe' merge rule needs each update's base parameters and a loss to probe "
                "(Arrival.base and Arrival.loss); vcdask's parameter server gives both"
            )
        check_layout(server, base)
        k = 1.0 / (max(0, arrival.staleness) + 1)
        ws = floats(server)
        # the float buffers move by neither the progress, the pull nor the momentum (zero there): every
        # candidate, and the merge, takes their average with the client's (buffer_weight: k)
        spans, weight = float_buffers(server, client), buffer_weight(arrival)
        averaged = {d: [torch.lerp(ws[d][r], client.arrays[d][r], weight) for r in runs] for d, runs in spans.items()}
        p = {d: torch.sub(client.arrays[d], base.arrays[d], out=scratch(state, f"p.{d}", w)) for d, w in ws.items()}
        back = {d: torch.sub(base.arrays[d], w, out=scratch(state, f"back.{d}", w)) for d, w in ws.items()}
        move = {d: scratch(state, f"move.{d}", w) for d, w in ws.items()}
        candidate = FlatParams(
            server.layout,
            {d: scratch(state, f"cand.{d}", a) if d in ws else client.arrays[d] for d, a in server.arrays.items()},
        )
        momentum = floats(state.arrays["momentum"]) if self.with_momentum else {}
        if spans:  # (and the momentum of a state saved before the buffers were told apart)
            zero_buffers(p, spans)
            zero_buffers(back, spans)
            zero_buffers(momentum, spans)
        losses: dict[tuple[float, float, float], float] = {}

        def put(vectors: dict[str, torch.Tensor]) -> None:  # the buffers' average, in place
            for d, runs in spans.items():
                for run, value in zip(runs, averaged[d], strict=True):
                    vectors[d][run].copy_(value)

        def fill(a: float, b: float, mu: float) -> None:  # move = k (a p + b back) [+ mu m]; candidate = W_s + move
            for d, w in ws.items():
                torch.mul(p[d], a, out=move[d]).add_(back[d], alpha=b).mul_(k)
                if mu:
                    move[d].add_(momentum[d], alpha=mu)
                torch.add(w, move[d], out=candidate.arrays[d])
            put(candidate.arrays)

        def best(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
            if len(points) == 1:
                return points[0]
            for point in points:
                if point not in losses:
                    fill(*point)
                    value = float(loss(candidate))
                    losses[point] = value if not math.isnan(value) else math.inf
            return min(points, key=lambda point: losses[point])  # (ties: the first)

        pulls = self.pulls if arrival.staleness > 0 else (1.0,)
        a = best([(a, 1.0, 0.0) for a in self.steps])[0]
        b = best([(a, b, 0.0) for b in pulls])[1]
        moving = self.with_momentum and any(bool(m.any()) for m in momentum.values())  # (zero: nothing to probe)
        mu = best([(a, b, mu) for mu in self.momenta])[2] if moving else 0.0
        fill(a, b, mu)
        for d, w in ws.items():
            if self.with_momentum:
                momentum[d].copy_(move[d])
            w.add_(move[d])
        put(ws)
        copy_non_float(server, client)
        state.scalars.update(step=a, pull=b, momentum=mu, probes=len(losses))
        return {"alpha": None, "applied": True}

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "steps": list(self.steps),
            "pulls": list(self.pulls),
            "momenta": list(self.momenta),
            "rows": self.rows,
        }
