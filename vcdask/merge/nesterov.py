"""An outer SGD step with Nesterov momentum on the pseudo-gradient (DiLoCo), optionally delayed."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from ..params import FlatParams
from ._base import (
    Arrival,
    MergeRule,
    RuleState,
    average_buffers,
    buffer_weight,
    check_layout,
    copy_non_float,
    float_buffers,
    floats,
    parameter_runs,
    scratch,
    zero_buffers,
    zeros_like,
)

__all__ = ["Nesterov"]

logger = logging.getLogger(__name__)

#: The momentum step count the bias correction stops at (its factor is 1 to float precision long before).
_WARM = 10**9
#: ``bias_correction`` "trust" / "agreement": a correction within this of 1 (half float32's epsilon) rounds to 1
#: in float32; it is not computed then (from momentum step 158 with momentum 0.9: four passes fewer per window)
_NEGLIGIBLE = 2.0**-24
#: ``bias_correction="agreement"`` and ``"trust"``: the longest momentum step the correction may make, over |W_s|
_TRUST = 0.5


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
    synchronous outer step does, without waiting for anyone.  With ``lr=1, momentum=0`` and
    ``delay=1`` it is ``W_s <- W_c``.

    With ``bias_correction=True`` the momentum term of the ``t``-th momentum step is divided
    by ``1 - momentum**t``, as Adam corrects its first moment: ``m`` starts at zero, so without it the
    first steps move the server ``1 + momentum * (1 - momentum**t) / (1 - momentum)`` times ``lr * g``
    instead of the steady ``1 + momentum / (1 - momentum)``, and a short run spends its first
    ``~1 / (1 - momentum)`` windows at a fraction of its pace (measured on the digits and a tabular
    task, 8 epochs: see the merge-rules guide).  The steady state is unchanged.

    That full correction trusts the first window's pseudo-gradient as if it persisted, and it does
    not: on the digits and the wide CNN the next window's mean pseudo-gradient points back along the
    momentum (cosine -0.9: the step overshot, local training pulls back), and the wide CNN's first
    corrected step moved the server by 1.8 times its parameters' norm.  With
    ``bias_correction="agreement"`` the correction is bounded twice:

    * it may not make a momentum step longer than half the server's parameter norm
      (``lr * momentum * gain * |m| <= 0.5 * |W_s|``, ``m`` after the step, ``|W_s|`` as the momentum
      step starts: with ``delay=N > 1`` after the closing arrival's share ``lr * g / N``, with ``delay=1``,
      where the arrival's step and the momentum step are one, before it; the gain never below 1);
    * from the second momentum step on, it is scaled by the cosine between the window's mean
      pseudo-gradient and the momentum before it, clipped at zero: momentum the new
      pseudo-gradients confirm is corrected as Adam would, momentum they contradict is not
      amplified::

        gain_t = 1 + (min(1 / (1 - momentum**t), bound_t) - 1) * max(0, cos(mean g, m))

    The steady state (``gain`` 1) is the same under every setting.  Measured (stop 29, the
    merge-rules guide): it brings the wide CNN with a 2x worker to 0.95 in about DDP's time, where
    Adam's correction takes 1.3-1.6x, but costs digits 0.2-0.3x of DDP's time: there the corrected
    steps stay well within the bound and help although the next window points back.

    ``bias_correction="trust"`` (the default) always applies the bound, and weighs the cosine by how
    much the bound has had to cut a correction so far, ``w = max_t (full_t - bounded_t) / (full_t - 1)``::

        gain_t = 1 + (min(1 / (1 - momentum**t), bound_t) - 1) * (1 - w * (1 - max(0, cos)))

    A model whose first updates are small against its parameters (digits, the tabular task: the
    bound never cuts, ``w = 0``) gets Adam's correction; one whose first updates are large (the wide
    CNN, ``w`` about 0.8; the char-LM about 0.3) gets nearly ``"agreement"``'s.  ``w`` is kept in the
    rule's state (``bounded``), so a resumed run keeps it.

    Float buffers (BatchNorm's ``running_mean`` and ``running_var``: the layout's ``buffers``) are no
    parameters and take no step: momentum carried a running variance that fell from update to update
    below zero (eval-mode outputs NaN).  Their pseudo-gradient and momentum are zero (a state saved
    with momentum on them has it dropped), the bound above is on the parameters' norm, and they take
    ``1 / (staleness + 1)`` of the client's: a fresh update's replace them, as its
    ``num_batches_tracked`` does (see the merge-rules guide).  A model without buffers merges as before.

    Parameters
    ----------
    lr : float, default 0.7
    momentum : float, default 0.9
    delay : int, optional
        Default: the number of shard tasks the run keeps in flight (:meth:`for_run`; ``fit`` sets
        it from the cluster's threads and ``tasks_per_slot``).  Measured on digits with 4 in flight:
        a step per arrival (``delay=1``) with lr 0.7 and momentum 0.9 diverged (accuracy 0.12);
        ``delay=4`` reached 0.975 (see ``benchmarks/strategies.py``).
    bias_correction : {"trust", True, "agreement", False}, default "trust"
        True: divide the momentum term by ``1 - momentum**t`` (``t``: momentum steps so far).
        ``"agreement"``: that correction, bounded, and as far as the pseudo-gradients agree with
        the momentum (above).  ``"trust"``: True within the same bound, with the cosine weighed by ``w``,
        the largest share of a correction the bound has cut so far (above): Adam's correction until the
        bound first cuts, ``"agreement"``'s only once a cut has taken a correction all the way down to 1.
        False: PyTorch's ``SGD(nesterov=True)`` step on the pseudo-gradient.
    """

    lr: float = 0.7
    momentum: float = 0.9
    delay: int | None = None
    bias_correction: bool | Literal["agreement", "trust"] = "trust"
    name: ClassVar[str] = "nesterov"

    def __post_init__(self) -> None:
        if not (0 < self.lr <= 10 and math.isfinite(self.lr)):
            raise ValueError(f"lr={self.lr!r}: must be in (0, 10]")
        if not (0 <= self.momentum < 1):
            raise ValueError(f"momentum={self.momentum!r}: must be in [0, 1)")
        if self.delay is not None and not (isinstance(self.delay, int) and self.delay >= 1):
            raise ValueError(f"delay={self.delay!r}: must be an integer >= 1 (or None: the tasks in flight)")
        if not (isinstance(self.bias_correction, bool) or self.bias_correction in ("agreement", "trust")):
            raise ValueError(f"bias_correction={self.bias_correction!r}: must be True, False, 'agreement' or 'trust'")

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

    def _momentum_gain(
        self,
        state: RuleState,
        m: FlatParams,
        g: dict[str, torch.Tensor],
        server: FlatParams,
        spans: dict[str, list[slice]],
    ) -> float:
        """Count one more momentum step; the factor on its momentum term.  ``g`` is the sum of the
        window's pseudo-gradients, ``m`` the momentum before this step (both zero at the float buffers,
        ``spans``: the bound is on the parameters' norm, without the buffers)."""
        steps = int(state.scalars.get("steps", 0))
        if steps == 0 and any(bool(b.any()) for b in floats(m).values()):
            steps = _WARM  # a state saved before the count existed: its momentum is already built up
        state.scalars["steps"] = steps = min(steps + 1, _WARM)
        if not self.bias_correction or self.momentum == 0:
            return 1.0
        full = 1.0 / (1.0 - self.momentum**steps)
        if self.bias_correction is True or full == 1.0:
            return full
        if full - 1.0 < _NEGLIGIBLE:  # every gain in [1, full] rounds to 1 in float32
            return 1.0
        n, mu = self._delay(), self.momentum
        mom = floats(m)
        dot, gg, mm = (_dot(g, mom), _dot(g, g), _dot(mom, mom))
        # |m| after this step (mu * m + g / n), from the same sums
        after = math.sqrt(max(0.0, mu * mu * mm + 2 * mu * dot / n + gg / (n * n)))
        room = _TRUST * math.sqrt(_parameters_norm2(floats(server), spans))
        gain = full if after == 0.0 else min(full, max(1.0, room / (self.lr * mu * after)))
        if gain < full:
            logger.debug("momentum step %d: correction bounded to %.3g (Adam's: %.3g)", steps, gain, full)
        # "agreement" weighs the cosine fully; "trust" as much as the bound has cut a correction so far
        weight = 1.0
        if self.bias_correction == "trust":
            cut = (full - gain) / (full - 1.0)
            weight = state.scalars["bounded"] = max(float(state.scalars.get("bounded", 0.0)), cut)
        if steps > 1 and weight > 0.0:
            cosine = 0.0 if gg == 0.0 or mm == 0.0 else dot / math.sqrt(gg * mm)
            gain = 1.0 + (gain - 1.0) * (1.0 - weight * (1.0 - max(0.0, cosine)))
        return gain

    def apply(self, server: FlatParams, client: FlatParams, state: RuleState, arrival: Arrival) -> dict[str, Any]:
        check_layout(server, client)
        m = state.arrays["momentum"]
        # the float buffers get no pseudo-gradient and no momentum (zero there: the steps leave them as
        # they are), and are averaged with the client's at the end (buffer_weight)
        spans = float_buffers(server, client)
        if self._delay() == 1:
            g = {d: torch.sub(ws, client.arrays[d], out=scratch(state, d, ws)) for d, ws in floats(server).items()}
            if spans:  # (and the momentum of a state saved before the buffers were told apart)
                zero_buffers(g, spans)
                zero_buffers(floats(m), spans)
            gain = self._momentum_gain(state, m, g, server, spans)
            for dtype, ws in floats(server).items():
                buf = m.arrays[dtype]
                buf.mul_(self.momentum).add_(g[dtype])
                ws.sub_(g[dtype].add_(buf, alpha=self.momentum * gain), alpha=self.lr)
        else:
            pending = state.arrays["pending"]
            state.scalars["arrivals"] += 1
            window_done = state.scalars["arrivals"] >= self._delay()
            opens = state.scalars["arrivals"] == 1  # the window's sum is zero until this arrival
            for dtype, ws in floats(server).items():
                if opens:  # the pseudo-gradient goes straight into the sum: a pass fewer
                    pseudo = torch.sub(ws, client.arrays[dtype], out=pending.arrays[dtype])
                    zero_buffers({dtype: pseudo}, spans)
                else:
                    pseudo = torch.sub(ws, client.arrays[dtype], out=scratch(state, dtype, ws))
                    zero_buffers({dtype: pseudo}, spans)
                    pending.arrays[dtype].add_(pseudo)
                ws.sub_(pseudo, alpha=self.lr / self._delay())
            if window_done:
                if spans:  # (a state saved before the buffers were told apart)
                    zero_buffers(floats(pending), spans)
                    zero_buffers(floats(m), spans)
                gain = self._momentum_gain(state, m, floats(pending), server, spans)
                for dtype, ws in floats(server).items():
                    buf = m.arrays[dtype]
                    buf.mul_(self.momentum).add_(pending.arrays[dtype], alpha=1.0 / self._delay())
                    ws.sub_(buf, alpha=self.lr * self.momentum * gain)
                    pending.arrays[dtype].zero_()
                state.scalars["arrivals"] = 0
        average_buffers(server, client, spans, buffer_weight(arrival))
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


def _parameters_norm2(ws: dict[str, torch.Tensor], spans: dict[str, list[slice]]) -> float:
    """|W_s|^2 of the parameters: summed over what lies between the float buffers (``spans``), not the whole
    less the buffers' share (running variances of raw features, 1e8 and more, left nothing of it in float32)."""
    parts = {
        f"{dtype}:{run.start}": vector[run]
        for dtype, vector in ws.items()
        for run in parameter_runs(vector.numel(), spans.get(dtype, []))
    }
    return _dot(parts, parts)


def _dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The dot product of two sets of float tensors (keyed alike) taken as one vector."""
    total = 0.0
    for key, x in a.items():
        x, y = x.ravel(), b[key].ravel()
        if x.dtype not in (torch.float32, torch.float64):
            x, y = x.float(), y.float()
        total += float(torch.dot(x, y))
    return total
