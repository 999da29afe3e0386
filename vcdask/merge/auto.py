"""The default for many tasks in flight: the probe rule where the server can afford it (issue 38)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .._ints import is_real
from ..params import FlatParams
from ._base import Arrival, MergeRule, RuleState
from .nesterov import Nesterov
from .probe import Probe

__all__ = ["Auto"]

logger = logging.getLogger("vcdask")

#: :class:`Auto` times a probe pass up to 3 times, while the passes so far took less than this (seconds).
TIMING_SECONDS = 0.25


@dataclass
class Auto(MergeRule):
    """:class:`Probe` when its probe costs the merge thread little next to the tasks, else ``fallback``.

    The choice is made once, at the run's first merge, before anything is merged: the server's probe is
    timed on the current parameters (the median of up to 3 passes after one that reads the rows) and
    scaled to the :attr:`Probe.passes` of a merge, and the first update's time at its worker's pace
    (``Arrival.seconds``) stands for a task.  With ``in_flight`` tasks each taking ``T``, updates
    arrive ``in_flight / T`` a second, so the probe keeps the merge thread busy a fraction

    ``in_flight * probe_seconds / T``

    of the time.  At most ``budget`` of it, the rule probes.  The probe is timed over :attr:`Probe.rows` rows
    halved down to ``min_rows`` (64: 16, 32, 64), fewest first, and the rule probes with the most rows that
    fit.  Where even the fewest do not, the same is tried with ``light``, a probe of fewer candidates (4
    passes a merge where ``probe`` takes 9).  If that does not fit either, merges would queue behind each
    other and the workers would wait for them, so ``fallback`` merges instead (a model too costly to probe
    costs the first merge a few passes over ``min_rows`` rows).  A large model trained on GPUs is the
    typical case: its probe runs on the scheduler's CPU.  Fewer than ``min_in_flight`` tasks in flight:
    ``fallback``, with no probe (at 2 workers the probe rule was level with delayed Nesterov at equal
    tokens, and slower to a target with mixed-speed workers).

    The choice and what it was made from are the state's scalars ``chosen``, ``light`` (whether the light
    probe was chosen), ``probe_rows``, ``probe_seconds``, ``task_seconds`` and ``busy`` (in every
    version's ``rule_state``; None where not measured; with the fallback, those of the cheapest probe
    timed), so a resumed run keeps it.  A probe that fails (a model or step that cannot run on the
    scheduler's CPU) is logged, its error kept as ``probe_error``, and the fallback merges.
    ``Arrival.loss`` takes an optional ``rows`` (the server's probe does).

    Parameters
    ----------
    probe : Probe, default Probe()
        The rule where the probe is affordable.
    fallback : MergeRule, default Nesterov(lr=0.5, momentum=0.9)
        The rule where it is not (:data:`vcdask.merge.DEFAULT_RULE` as ``fit``'s default uses it).
    light : Probe or None, default Probe(steps=(1, 2), pulls=(0.5, 1), momenta=(0, 0.9))
        A cheaper probe, tried where ``probe`` does not fit (None: none).  Its rows are ``probe``'s.  In the
        simulation of issue 38 (16 rows) it was 0.6 points behind the full grid on digits at 4 workers and
        level at 8, and 0.5% / 3.4% behind on the char-LM at 4 / 8; delayed Nesterov, 4-13 points and
        10-16% behind it (the docs' benchmarks page, stop 50).
    budget : float, default 0.75
        The most of the merge thread's time the probe may take, in ``(0, 10]``.
    min_in_flight : int, default 4
        The fewest tasks in flight for which the probe is considered.
    min_rows : int, default 16
        The fewest probe rows the rule halves down to (the simulation of issue 38: 32 and 64 rows did as
        well on the char-LM and on digits at 8 workers, 16 lost 1.4 points on digits; 8 lost 17 points on
        digits at 8 workers).
    in_flight : int, optional
        Tasks the run keeps in flight; None: ``fit`` sets it to those of the cluster when the run starts
        (:meth:`for_run`).  Give it for a fleet that will grow (spot instances still starting): a run
        given this rule that starts with fewer than ``min_in_flight`` merges with ``fallback`` for good
        (``fit``'s default, when no rule is given, moves up to ``"auto"`` as the fleet grows).
    """

    probe: Probe = field(default_factory=Probe)
    fallback: MergeRule = field(default_factory=lambda: Nesterov(lr=0.5, momentum=0.9))
    light: Probe | None = field(default_factory=lambda: Probe(steps=(1.0, 2.0), pulls=(0.5, 1.0), momenta=(0.0, 0.9)))
    budget: float = 0.75
    min_in_flight: int = 4
    min_rows: int = 16
    in_flight: int | None = None
    name: ClassVar[str] = "auto"
    needs: ClassVar[frozenset[str]] = frozenset({"base", "loss"})

    def __post_init__(self) -> None:
        if not isinstance(self.probe, Probe):
            raise TypeError(f"probe must be a vcdask.merge.Probe, got {self.probe!r}")
        if self.light is not None and not isinstance(self.light, Probe):
            raise TypeError(f"light must be a vcdask.merge.Probe or None, got {self.light!r}")
        if self.light is not None and self.light.rows != self.probe.rows:
            self.light = dataclasses.replace(self.light, rows=self.probe.rows)  # (its rows are the probe's)
        if not isinstance(self.fallback, MergeRule) or isinstance(self.fallback, Auto) or self.fallback.needs:
            raise TypeError(
                "fallback must be a vcdask.merge.MergeRule that needs no probe (e.g. Nesterov()), "
                f"got {self.fallback!r}"
            )
        budget = self.budget
        if not is_real(budget) or not 0 < budget <= 10:
            raise ValueError(f"budget={budget!r}: must be a number in (0, 10]")
        for name in ("min_in_flight", "min_rows", "in_flight"):
            value = getattr(self, name)
            if (value is not None or name != "in_flight") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")

    def for_run(self, *, samples_per_epoch: int | None = None, in_flight: int | None = None) -> MergeRule:
        """``fallback`` as the run uses it for fewer than :attr:`min_in_flight` tasks in flight, else this
        rule with both of its rules and ``in_flight`` filled in.  An :attr:`in_flight` given to the rule
        wins over the run's (as :class:`Nesterov`'s ``delay`` does)."""
        in_flight = self.in_flight or in_flight
        fallback = self.fallback.for_run(samples_per_epoch=samples_per_epoch, in_flight=in_flight)
        if in_flight is not None and in_flight < self.min_in_flight:
            return fallback
        probe = self.probe.for_run(samples_per_epoch=samples_per_epoch, in_flight=in_flight)
        assert isinstance(probe, Probe)
        light: Probe | None = None
        if self.light is not None:
            ready = self.light.for_run(samples_per_epoch=samples_per_epoch, in_flight=in_flight)
            assert isinstance(ready, Probe)
            light = ready
        return dataclasses.replace(self, probe=probe, fallback=fallback, light=light, in_flight=in_flight)

    @property
    def rows(self) -> int:
        """The rows the server's probe scores on (:attr:`Probe.rows`)."""
        return self.probe.rows

    def chosen(self, state: RuleState) -> MergeRule | None:
        """The rule chosen at the first merge (None before it)."""
        name = state.scalars.get("chosen")
        if name is None:
            return None
        if name != self.probe.name:
            return self.fallback
        if state.scalars.get("light"):
            if self.light is None:
                raise ValueError(
                    "this run's 'auto' rule chose its light probe, and this Auto has none (light=None); "
                    "resume it with the rule it started with"
                )
            probe = self.light
        else:
            probe = self.probe
        rows = int(state.scalars.get("probe_rows") or self.probe.rows)
        return probe if rows == probe.rows else dataclasses.replace(probe, rows=rows)

    def label(self, state: RuleState) -> str:
        """``"auto"`` before the first merge, then what it chose: ``"auto: probe, 16 rows"``, ``"auto: light
        probe, 16 rows"`` or ``"auto: nesterov"``."""
        chosen = self.chosen(state)
        if chosen is None:
            return self.name
        if not isinstance(chosen, Probe):
            return f"{self.name}: {chosen.label(state)}"
        return f"{self.name}: {'light probe' if state.scalars.get('light') else 'probe'}, {chosen.rows} rows"

    def requires(self, state: RuleState) -> frozenset[str]:
        chosen = self.chosen(state)
        return self.needs if chosen is None else chosen.needs

    def state_arrays(self, server: FlatParams, state: RuleState) -> set[str]:
        chosen = self.chosen(state)
        return set() if chosen is None else chosen.state_arrays(server, state)

    def apply(self, server: FlatParams, client: FlatParams, state: RuleState, arrival: Arrival) -> dict[str, Any]:
        rule = self.chosen(state)
        if rule is None:
            rule = self._choose(server, state, arrival)
        if isinstance(rule, Probe) and rule.rows != self.probe.rows and arrival.loss is not None:
            arrival = dataclasses.replace(arrival, loss=functools.partial(arrival.loss, rows=rule.rows))
        return rule.apply(server, client, state, arrival)

    def _choose(self, server: FlatParams, state: RuleState, arrival: Arrival) -> MergeRule:
        loss = arrival.loss
        if loss is None:
            raise ValueError(
                "the 'auto' merge rule times the server's probe of the training loss at its first merge "
                "(Arrival.loss); vcdask's parameter server gives it"
            )
        if self.in_flight is None:
            raise ValueError("Auto(in_flight=None) takes the tasks in flight from the run (vcdask.fit sets it)")
        task = arrival.seconds
        if task is not None and not (math.isfinite(task) and task > 0):
            task = None  # (a task of unknown length: no grounds for the probe)
        rule: MergeRule = self.fallback
        rows: int | None = None
        probe_seconds = busy = None
        light = False
        try:
            # fewest rows first: a model too costly to probe is found out by the cheapest passes
            period, per_pass = task or 1.0, {}
            grids = [(False, self.probe)] + ([(True, self.light)] if self.light is not None else [])
            for is_light, grid in grids if task is not None else []:
                for i, count in enumerate(self._counts()):
                    if count not in per_pass:
                        per_pass[count] = self._time(loss, server, count)
                    seconds = per_pass[count] * grid.passes
                    share = self.in_flight * seconds / period
                    fits = share <= self.budget
                    if fits or i == 0:  # (where nothing fits: the cheapest probe tried)
                        rows, probe_seconds, busy, light = count, seconds, share, is_light and fits
                    if not fits:
                        break
                    rule = grid if count == grid.rows else dataclasses.replace(grid, rows=count)
                if rule is not self.fallback:
                    break
        except Exception as e:  # noqa: BLE001  the model cannot run here (a step that needs a GPU): fall back
            logger.warning("merge rule 'auto': the server cannot probe this model (%s: %s)", type(e).__name__, e)
            rule, light = self.fallback, False
            rows = probe_seconds = busy = None
            state.scalars["probe_error"] = f"{type(e).__name__}: {e}"[:500]
        state.scalars.update(
            chosen=rule.name,
            light=light,
            probe_rows=rows,
            probe_seconds=_rounded(probe_seconds),
            task_seconds=_rounded(task),
            busy=_rounded(busy),
        )
        fresh = rule.init_state(server)
        state.arrays.update(fresh.arrays)
        state.scalars.update(fresh.scalars)
        logger.info(
            "merge rule %r%s: a merge's probe over %s rows takes %s s here, a task %s s, %d in flight: the probe "
            "would keep the merge thread %s busy (budget %.0f%%)",
            rule.name,
            " (light)" if light else "",
            "?" if rows is None else rows,
            "?" if probe_seconds is None else f"{probe_seconds:.3g}",
            "?" if task is None else f"{task:.3g}",
            self.in_flight,
            "?" if busy is None else f"{busy:.0%}",
            100 * self.budget,
        )
        return rule

    def _counts(self) -> list[int]:
        """The probe's row counts to try, fewest first: :attr:`Probe.rows` halved down to :attr:`min_rows`."""
        counts = [self.probe.rows]
        while counts[-1] // 2 >= self.min_rows:
            counts.append(counts[-1] // 2)
        return counts[::-1]

    def _time(self, loss: Callable[..., float], server: FlatParams, rows: int) -> float:
        """A probe pass over ``rows`` rows, in seconds: the median of up to 3 passes (as many as fit in
        :data:`TIMING_SECONDS`) after a first one, which reads and cuts the rows."""
        call = loss if rows == self.probe.rows else functools.partial(loss, rows=rows)
        call(server)
        times: list[float] = []
        while len(times) < 3 and sum(times) < TIMING_SECONDS:
            t0 = time.perf_counter()
            call(server)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "probe": self.probe.describe(),
            "fallback": self.fallback.describe(),
            "light": None if self.light is None else self.light.describe(),
            "budget": self.budget,
            "min_in_flight": self.min_in_flight,
            "min_rows": self.min_rows,
            "in_flight": self.in_flight,
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
