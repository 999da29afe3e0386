"""Merge rules: how the server folds one client update ``W_c`` into ``W_s``, as it arrives.

A rule is a small object with pure functions over flat parameters (one 1-D tensor per dtype):
``init_state(server)`` gives its state (e.g. a momentum buffer, as :class:`FlatParams` laid out
like the server parameters, plus JSON scalars), ``apply(server, client, state, arrival)``
changes ``server`` and ``state`` in place.  The state is committed with every version (the
store's ``/rule/<name>`` groups and the version's metadata), so a resumed run continues exactly.

Floating-point vectors are merged; integer and boolean state (e.g. BatchNorm's
``num_batches_tracked``) cannot be averaged and takes the client's value, for every rule.

Rules by name (``fit(..., merge=...)``):

``"vc-asgd"``
    The paper's rule, ``W_s <- alpha W_s + (1 - alpha) W_c``, alpha constant or scheduled.
``"staleness"``
    FedAsync (Xie et al. 2019): the client's weight ``(1 - alpha) * s(staleness)`` shrinks with
    the update's staleness; ``s(t) = (t + 1) ** -a`` or a hinge.
``"nesterov"``
    An outer optimizer (DiLoCo, Douillard et al. 2023): pseudo-gradient ``g = W_s - W_c``, one
    SGD step with Nesterov momentum per arrival (lr 0.7, momentum 0.9).
``"sync"``
    DeDLOC-style large batch: collect updates until ``target_samples`` samples, then replace
    ``W_s`` by their sample-weighted mean at once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .errors import ParameterMismatchError, VcdaskError
from .params import FlatParams
from .schedules import Constant, EpochSchedule, check_alpha, get_schedule

__all__ = ["DEFAULT_RULE", "Arrival", "MergeRule", "Nesterov", "RuleState", "Staleness", "Sync", "UnknownMergeRuleError",
           "VCASGD", "get_rule", "rules"]


class UnknownMergeRuleError(VcdaskError, ValueError):
    """A merge rule name that is not registered (the message lists those that are)."""


@dataclass(frozen=True)
class Arrival:
    """What a rule knows of one update when it arrives."""

    epoch: int
    staleness: int = 0  # merges since the update's base version
    n_samples: int = 1  # rows its shard trained on


@dataclass
class RuleState:
    """A rule's state: arrays laid out like the server parameters, and JSON scalars."""

    arrays: dict[str, FlatParams] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)


def _describe_alpha(schedule) -> float | str:
    if isinstance(schedule, Constant):
        return schedule.alpha
    if isinstance(schedule, EpochSchedule):
        return "epoch"
    inner = getattr(schedule, "fn", None)  # a checked user callable
    return _describe_alpha(inner) if inner is not None and inner is not schedule else "callable"


def _check(server: FlatParams, client: FlatParams) -> None:
    if server.layout != client.layout:
        raise ParameterMismatchError("client update does not match the server parameters: "
                                     + "; ".join(server.layout.diff(client.layout)))


def _floats(params: FlatParams):
    return {d: a for d, a in params.arrays.items() if a.is_floating_point()}


def _zeros_like(params: FlatParams) -> FlatParams:
    return FlatParams(params.layout, {d: torch.zeros_like(a) for d, a in params.arrays.items()})


def _copy_non_float(server: FlatParams, client: FlatParams) -> None:
    for dtype, ws in server.arrays.items():
        if not ws.is_floating_point():
            ws.copy_(client.arrays[dtype])


def lerp(server: FlatParams, client: FlatParams, weight: float) -> None:
    """``server <- (1 - weight) * server + weight * client`` in place (``weight = 1 - alpha``)."""
    for dtype, ws in _floats(server).items():
        wc = client.arrays[dtype]
        if weight == 1.0:  # exact replacement, without rounding
            ws.copy_(wc)
        elif weight != 0.0:
            ws.lerp_(wc, weight)
    _copy_non_float(server, client)


class MergeRule(ABC):
    """How updates are folded into the server parameters; see the module docstring."""

    name: ClassVar[str]

    def init_state(self, server: FlatParams) -> RuleState:
        """The state before the first merge (none by default)."""
        return RuleState()

    @abstractmethod
    def apply(self, server: FlatParams, client: FlatParams, state: RuleState, arrival: Arrival) -> dict[str, Any]:
        """Fold ``client`` into ``server`` (in place), updating ``state`` (in place).

        Returns
        -------
        dict
            For the history: ``alpha`` (the server copy's weight, where the rule has one),
            ``applied`` (False when the update was only collected, e.g. by ``sync``).
        """

    def describe(self) -> dict[str, Any]:
        """Name and parameters, stored with every version."""
        return {"name": self.name}


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

    def __post_init__(self):
        self.schedule = get_schedule(self.alpha)

    def apply(self, server, client, state, arrival):
        _check(server, client)
        alpha = float(self.schedule(arrival.epoch))
        lerp(server, client, 1.0 - alpha)
        return {"alpha": alpha, "applied": True}

    def describe(self):
        return {"name": self.name, "alpha": _describe_alpha(self.schedule)}


@dataclass
class Staleness(MergeRule):
    """FedAsync's staleness-aware mixing: the client's weight is ``(1 - alpha) * s(staleness)``.

    Parameters
    ----------
    alpha : float, "epoch" or callable, default 0.5
        As for :class:`VCASGD`, for a fresh (staleness 0) update.
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

    def __post_init__(self):
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

    def apply(self, server, client, state, arrival):
        _check(server, client)
        weight = (1.0 - float(self.schedule(arrival.epoch))) * self.decay(arrival.staleness)
        lerp(server, client, weight)
        return {"alpha": 1.0 - weight, "applied": True}

    def describe(self):
        return {"name": self.name, "alpha": _describe_alpha(self.schedule), "function": self.function,
                "a": self.a, "b": self.b}


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

    Parameters
    ----------
    lr : float, default 0.7
    momentum : float, default 0.9
    delay : int, optional
        Default: the number of shard tasks the run keeps in flight (``fit`` sets it from the
        cluster's threads and ``tasks_per_slot``).  Measured on digits with 4 in flight: a step
        per arrival (``delay=1``) with lr 0.7 and momentum 0.9 diverged (accuracy 0.12);
        ``delay=4`` reached 0.975 (see ``benchmarks/strategies.py``).
    """

    lr: float = 0.7
    momentum: float = 0.9
    delay: int | None = None
    name: ClassVar[str] = "nesterov"

    def __post_init__(self):
        if not (0 < self.lr <= 10 and math.isfinite(self.lr)):
            raise ValueError(f"lr={self.lr!r}: must be in (0, 10]")
        if not (0 <= self.momentum < 1):
            raise ValueError(f"momentum={self.momentum!r}: must be in [0, 1)")
        if self.delay is not None and not (isinstance(self.delay, int) and self.delay >= 1):
            raise ValueError(f"delay={self.delay!r}: must be an integer >= 1 (or None: the tasks in flight)")

    def in_flight(self, n: int) -> Nesterov:
        """This rule with ``delay`` set to ``n`` if it was left to the run."""
        return self if self.delay is not None else Nesterov(lr=self.lr, momentum=self.momentum, delay=max(1, n))

    def _delay(self) -> int:
        if self.delay is None:
            raise ValueError("Nesterov(delay=None) takes its delay from the run (vcdask.fit sets it); pass delay=")
        return self.delay

    def init_state(self, server):
        arrays = {"momentum": _zeros_like(server)}
        if self._delay() > 1:
            arrays["pending"] = _zeros_like(server)
            return RuleState(arrays=arrays, scalars={"arrivals": 0})
        return RuleState(arrays=arrays)

    def apply(self, server, client, state, arrival):
        _check(server, client)
        m = state.arrays["momentum"]
        if self._delay() == 1:
            for dtype, ws in _floats(server).items():
                g = ws - client.arrays[dtype]
                buf = m.arrays[dtype]
                buf.mul_(self.momentum).add_(g)
                ws.sub_(g.add_(buf, alpha=self.momentum), alpha=self.lr)
        else:
            pending = state.arrays["pending"]
            state.scalars["arrivals"] += 1
            window_done = state.scalars["arrivals"] >= self.delay
            for dtype, ws in _floats(server).items():
                g = ws - client.arrays[dtype]
                pending.arrays[dtype].add_(g)
                ws.sub_(g, alpha=self.lr / self.delay)
                if window_done:
                    buf = m.arrays[dtype]
                    buf.mul_(self.momentum).add_(pending.arrays[dtype], alpha=1.0 / self.delay)
                    ws.sub_(buf, alpha=self.lr * self.momentum)
                    pending.arrays[dtype].zero_()
            if window_done:
                state.scalars["arrivals"] = 0
        _copy_non_float(server, client)
        return {"alpha": None, "applied": True}

    def describe(self):
        return {"name": self.name, "lr": self.lr, "momentum": self.momentum, "delay": self.delay}


@dataclass
class Sync(MergeRule):
    """Synchronous large-batch merging (DeDLOC): collect updates until ``target_samples`` samples,
    then ``W_s <- sum(n_i W_c_i) / sum(n_i)`` at once; ``W_s`` is unchanged in between.

    Parameters
    ----------
    target_samples : int
        Samples per merge; :func:`vcdask.fit` defaults it to one epoch's rows (every shard).
    """

    target_samples: int | None = None
    name: ClassVar[str] = "sync"

    def __post_init__(self):
        if self.target_samples is not None and self.target_samples < 1:
            raise ValueError(f"target_samples={self.target_samples!r}: must be >= 1")

    def init_state(self, server):
        return RuleState(arrays={"sum": _zeros_like(server)}, scalars={"samples": 0, "updates": 0})

    def apply(self, server, client, state, arrival):
        _check(server, client)
        if self.target_samples is None:
            raise ValueError("Sync needs target_samples (vcdask.fit sets it to one epoch's rows)")
        total = state.arrays["sum"]
        n = int(arrival.n_samples)
        for dtype, ws in _floats(server).items():
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

    def describe(self):
        return {"name": self.name, "target_samples": self.target_samples}


rules: dict[str, type[MergeRule]] = {r.name: r for r in (VCASGD, Staleness, Nesterov, Sync)}

#: The rule ``vcdask.fit`` uses when neither ``merge`` nor ``alpha`` is given: delayed Nesterov
#: (one momentum step per tasks-in-flight arrivals) with lr 0.5, momentum 0.8.  Chosen by
#: ``benchmarks/strategies.py``: the best final accuracy on both tasks, within 1 point of
#: single-process torch (digits -0.84, wide CNN +0.14 points); see the docs' merge-rules page.
DEFAULT_RULE = Nesterov(lr=0.5, momentum=0.8)


def get_rule(merge: str | MergeRule, alpha: float | str | Callable[[int], float] | None = None,
             samples_per_epoch: int | None = None) -> MergeRule:
    """The rule for ``fit(merge=..., alpha=...)``.

    Raises
    ------
    UnknownMergeRuleError
        An unknown name (the message lists the registered ones).
    ValueError
        ``alpha`` given with a rule that has none, or a bad alpha.
    TypeError
        ``merge`` is neither a name nor a :class:`MergeRule`.
    """
    if isinstance(merge, MergeRule):
        if alpha is not None:
            raise ValueError(f"alpha={alpha!r} was given with a MergeRule instance ({merge.name}): set it on the rule")
        rule = merge
    elif isinstance(merge, str):
        cls = rules.get(merge)
        if cls is None:
            raise UnknownMergeRuleError(f"unknown merge rule {merge!r}; choose one of {sorted(rules)} "
                                        "or pass a vcdask.rules.MergeRule instance")
        if alpha is not None:
            if cls not in (VCASGD, Staleness):
                raise ValueError(f"alpha={alpha!r} does not apply to merge={merge!r} (only to 'vc-asgd' and "
                                 "'staleness'); configure the rule with an instance, e.g. vcdask.rules.Nesterov(lr=0.5)")
            if isinstance(alpha, (int, float)) and not isinstance(alpha, bool):
                check_alpha(float(alpha))
            rule = cls(alpha=alpha)
        else:
            rule = cls()
    else:
        raise TypeError(f"merge must be a rule name {sorted(rules)} or a MergeRule, got {type(merge).__name__}")
    if isinstance(rule, Sync) and rule.target_samples is None and samples_per_epoch is not None:
        rule = Sync(target_samples=samples_per_epoch)
    return rule
