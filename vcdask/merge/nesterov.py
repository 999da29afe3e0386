"""An outer SGD step with Nesterov momentum on the pseudo-gradient (DiLoCo), optionally delayed."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ..params import FlatParams
from ._base import Arrival, MergeRule, RuleState, check_layout, copy_non_float, floats, zeros_like

__all__ = ["Nesterov"]

#: The momentum step count the bias correction stops at (its factor is 1 to float precision long before).
_WARM = 10**9


@dataclass
class Nesterov(MergeRule):
    """An outer SGD step with Nesterov momentum on the pseudo-gradient ``g = W_s - W_c``::

        m   <- momentum * m + g
        W_s <- W_s - lr * (g + momentum * m)

    (PyTorch's ``SGD(nesterov=True)`` update.)  With ``delay=1`` the step is taken at every
    arrival.  With ``delay=N`` (delayed Nesterov, after Liu et al. 2024) each arrival applies its
    share ``lr * g / N`` at once and the momentum moves once per ``N`` arrivals, with the mean
    of their pseudo-gradients::

        W_s <- W_s - lr * g / N                       (every arrival)
        m   <- momentum * m + mean(g over the N);  W_s <- W_s - lr * momentum * m   (every N-th)

    so ``N`` arrivals together make one Nesterov step on their mean pseudo-gradient, as DiLoCo's
    synchronous outer step does, without waiting for anyone.  With ``lr=1, momentum=0`` it is
    ``W_s <- W_c``.

    With ``bias_correction`` (the default) the momentum term of the ``t``-th momentum step is divided
    by ``1 - momentum**t``, as Adam corrects its first moment: ``m`` starts at zero, so without it the
    first steps move the server ``1 + momentum * (1 - momentum**t) / (1 - momentum)`` times ``lr * g``
    instead of the steady ``1 + momentum / (1 - momentum)``, and a short run spends its first
    ``~1 / (1 - momentum)`` windows at a fraction of its pace (measured on the digits and a tabular
    task, 8 epochs: see the merge-rules guide).  The steady state is unchanged.

    Parameters
    ----------
    lr : float, default 0.7
    momentum : float, default 0.9
    delay : int, optional
        Default: the number of shard tasks the run keeps in flight (:meth:`for_run`; ``fit`` sets
        it from the cluster's threads and ``tasks_per_slot``).  Measured on digits with 4 in flight:
        a step per arrival (``delay=1``) with lr 0.7 and momentum 0.9 diverged (accuracy 0.12);
        ``delay=4`` reached 0.975 (see ``benchmarks/strategies.py``).
    bias_correction : bool, default True
        Divide the momentum term by ``1 - momentum**t`` (``t``: momentum steps so far).  False is
        PyTorch's ``SGD(nesterov=True)`` step on the pseudo-gradient.
    """

    lr: float = 0.7
    momentum: float = 0.9
    delay: int | None = None
    bias_correction: bool = True
    name: ClassVar[str] = "nesterov"

    def __post_init__(self) -> None:
        if not (0 < self.lr <= 10 and math.isfinite(self.lr)):
            raise ValueError(f"lr={self.lr!r}: must be in (0, 10]")
        if not (0 <= self.momentum < 1):
            raise ValueError(f"momentum={self.momentum!r}: must be in [0, 1)")
        if self.delay is not None and not (isinstance(self.delay, int) and self.delay >= 1):
            raise ValueError(f"delay={self.delay!r}: must be an integer >= 1 (or None: the tasks in flight)")
        if not isinstance(self.bias_correction, bool):
            raise TypeError(f"bias_correction={self.bias_correction!r}: must be True or False")

    def for_run(self, *, samples_per_epoch: int | None = None, in_flight: int | None = None) -> Nesterov:
        """This rule with ``delay`` set to the tasks in flight, if it was left to the run."""
        if self.delay is not None or in_flight is None:
            return self
        return dataclasses.replace(self, delay=max(1, in_flight))

    def _delay(self) -> int:
        if self.delay is None:
            raise ValueError("Nesterov(delay=None) takes its delay from the run (vcdask.fit sets it); pass delay=")
        return self.delay

    def init_state(self, server: FlatParams) -> RuleState:
        arrays = {"momentum": zeros_like(server)}
        scalars = {"steps": 0}  # momentum steps taken (for the bias correction)
        if self._delay() > 1:
            arrays["pending"] = zeros_like(server)
            scalars["arrivals"] = 0
        return RuleState(arrays=arrays, scalars=scalars)

    def _momentum_gain(self, state: RuleState, m: FlatParams) -> float:
        """Count one more momentum step; the factor on its momentum term (``1 / (1 - momentum**t)``)."""
        steps = int(state.scalars.get("steps", 0))
        if steps == 0 and any(bool(b.any()) for b in floats(m).values()):
            steps = _WARM  # a state saved before the count existed: its momentum is already built up
        state.scalars["steps"] = steps = min(steps + 1, _WARM)
        if not self.bias_correction or self.momentum == 0:
            return 1.0
        return 1.0 / (1.0 - self.momentum**steps)

    def apply(self, server: FlatParams, client: FlatParams, state: RuleState, arrival: Arrival) -> dict[str, Any]:
        check_layout(server, client)
        m = state.arrays["momentum"]
        if self._delay() == 1:
            gain = self._momentum_gain(state, m)
            for dtype, ws in floats(server).items():
                g = ws - client.arrays[dtype]
                buf = m.arrays[dtype]
                buf.mul_(self.momentum).add_(g)
                ws.sub_(g.add_(buf, alpha=self.momentum * gain), alpha=self.lr)
        else:
            pending = state.arrays["pending"]
            state.scalars["arrivals"] += 1
            window_done = state.scalars["arrivals"] >= self._delay()
            gain = self._momentum_gain(state, m) if window_done else 1.0
            for dtype, ws in floats(server).items():
                g = ws - client.arrays[dtype]
                pending.arrays[dtype].add_(g)
                ws.sub_(g, alpha=self.lr / self._delay())
                if window_done:
                    buf = m.arrays[dtype]
                    buf.mul_(self.momentum).add_(pending.arrays[dtype], alpha=1.0 / self._delay())
                    ws.sub_(buf, alpha=self.lr * self.momentum * gain)
                    pending.arrays[dtype].zero_()
            if window_done:
                state.scalars["arrivals"] = 0
        copy_non_float(server, client)
        return {"alpha": None, "applied": True}

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "lr": self.lr,
            "momentum": self.momentum,
            "delay": self.delay,
            "bias_correction": self.bias_correction,
        }
