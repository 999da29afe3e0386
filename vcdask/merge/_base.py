"""The merge-rule interface and the vector helpers every rule uses."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import ParameterMismatchError
from ..params import FlatParams, torch_dtype
from ..schedules import Constant, EpochSchedule

__all__ = ["Arrival", "MergeRule", "RuleState", "lerp"]


@dataclass(frozen=True)
class Arrival:
    """What a rule knows of one update when it arrives.

    ``base`` and ``loss`` are given only to a rule that asks for them (:meth:`MergeRule.requires`): the
    parameters the update was trained from, and a function giving the training loss of a candidate
    ``W_s`` on a fixed sample of the training rows (``loss(W, rows=n)``: on fewer of them).
    ``seconds``: how long the task took at its worker's pace (None where unknown).
    """

    epoch: int
    staleness: int = 0  # merges since the update's base version
    n_samples: int = 1  # rows its shard trained on
    base: FlatParams | None = field(default=None, repr=False)
    loss: Callable[..., float] | None = field(default=None, repr=False)
    seconds: float | None = None


@dataclass
class RuleState:
    """A rule's state: arrays laid out like the server parameters, and JSON scalars.

    Change the arrays in place with torch operations (``add_``, ``mul_``, ``copy_``, ...), or put new
    tensors in: a commit stores only the arrays PyTorch counts as changed since the last one (the
    tensor's version counter), and a change through ``.data`` or a NumPy view is not counted.
    """

    arrays: dict[str, FlatParams] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)
    #: Working memory a rule reuses from merge to merge (never stored): see :func:`scratch`.
    work: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)


class MergeRule(ABC):
    """How updates are folded into the server parameters; see :mod:`vcdask.merge`."""

    name: ClassVar[str]
    #: What the rule needs in each :class:`Arrival` beyond the epoch, staleness and sample count:
    #: ``"base"`` (the update's base parameters) and ``"loss"`` (a probe of the training loss).
    needs: ClassVar[frozenset[str]] = frozenset()

    def requires(self, state: RuleState) -> frozenset[str]:
        """What the next merge needs (:attr:`needs`), given the rule's ``state``: a rule that chooses
        between others at its first merge (:class:`vcdask.merge.Auto`) needs less once it has chosen."""
        return self.needs

    def label(self, state: RuleState) -> str:
        """What merges now, in a few words, for a run's status and panel (:attr:`name` by default; a rule
        that chooses between others says what it chose)."""
        return self.name

    def state_arrays(self, server: FlatParams, state: RuleState) -> set[str]:
        """The arrays a saved ``state`` must hold to resume (those of :meth:`init_state` by default)."""
        return set(self.init_state(server).arrays)

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

    def for_run(self, *, samples_per_epoch: int | None = None, in_flight: int | None = None) -> MergeRule:
        """This rule with the defaults it leaves to the run filled in (the one place they are set).

        Parameters
        ----------
        samples_per_epoch : int, optional
            Training rows per epoch.
        in_flight : int, optional
            Shard tasks the run keeps in flight.

        Returns
        -------
        MergeRule
            ``self`` when the rule takes nothing from the run, else a configured copy.
        """
        return self

    def describe(self) -> dict[str, Any]:
        """Name and parameters, stored with every version."""
        return {"name": self.name}


def describe_alpha(schedule: Any) -> float | str:
    """How an alpha schedule is recorded in a version's metadata."""
    if isinstance(schedule, Constant):
        return schedule.alpha
    if isinstance(schedule, EpochSchedule):
        return "epoch"
    inner = getattr(schedule, "fn", None)  # a checked user callable
    return describe_alpha(inner) if inner is not None and inner is not schedule else "callable"


def check_layout(server: FlatParams, client: FlatParams) -> None:
    """Raise :class:`ParameterMismatchError` unless both have the same layout."""
    if server.layout != client.layout:
        raise ParameterMismatchError(
            "client update does not match the server parameters: " + "; ".join(server.layout.diff(client.layout))
        )


def floats(params: FlatParams) -> dict[str, torch.Tensor]:
    """The floating-point vectors (the ones rules merge)."""
    return {d: a for d, a in params.arrays.items() if a.is_floating_point()}


def float_buffers(server: FlatParams, client: FlatParams) -> dict[str, list[slice]]:
    """Where the floating-point buffers (BatchNorm's running statistics: the layout's ``buffers``) lie
    in each float vector of ``server``, adjacent ones as one slice; empty for a model without them.

    The buffers of either layout: one stored by a vcdask that did not record them (a run resumed
    from an older store) knows none, the update a worker packs from its model does.
    """
    names = server.layout.buffers | client.layout.buffers
    spans: dict[str, list[slice]] = {}
    if not names:
        return spans
    for e in server.layout.entries:
        if e.name not in names or not e.size or not torch_dtype(e.dtype).is_floating_point:
            continue
        runs = spans.setdefault(e.dtype, [])
        if runs and runs[-1].stop == e.offset:
            runs[-1] = slice(runs[-1].start, e.offset + e.size)
        else:
            runs.append(slice(e.offset, e.offset + e.size))
    return spans


def parameter_runs(size: int, runs: list[slice]) -> list[slice]:
    """The slices of a float vector of ``size`` values that hold parameters: what lies between its float
    buffers' ``runs`` (one dtype's :func:`float_buffers`); the whole vector when it holds no buffers."""
    out, start = [], 0
    for run in sorted(runs, key=lambda r: r.start):
        if run.start > start:
            out.append(slice(start, run.start))
        start = max(start, run.stop)
    if start < size:
        out.append(slice(start, size))
    return out


def zero_buffers(vectors: dict[str, torch.Tensor], spans: dict[str, list[slice]]) -> None:
    """Zero the buffers' places (:func:`float_buffers`) of vectors laid out like the server's float ones:
    a pseudo-gradient or momentum that is zero there leaves the buffers where they are."""
    for dtype, vector in vectors.items():
        for run in spans.get(dtype, ()):
            vector[run].zero_()


def buffer_weight(arrival: Arrival) -> float:
    """The client's weight in the buffers' average, for the rules whose step is no convex average
    (:class:`~vcdask.merge.Nesterov`, :class:`~vcdask.merge.Probe`): ``1 / (staleness + 1)``.

    Momentum or a step longer than the update extrapolates, and a running variance extrapolated past
    its trend goes below zero (the model's outputs in eval mode are then NaN).  The buffers are
    statistics of the model, not trained, and are averaged instead, as :data:`~vcdask.merge.ONE_IN_FLIGHT`
    merges everything: an update based on the newest version brings its worker's statistics (with its
    ``num_batches_tracked``), one ``s`` merges old is averaged in with weight ``1 / (s + 1)``.
    """
    return 1.0 / (max(0, arrival.staleness) + 1)


def average_buffers(server: FlatParams, client: FlatParams, spans: dict[str, list[slice]], weight: float) -> None:
    """``buffer <- (1 - weight) * buffer + weight * client's`` in place, over :func:`float_buffers`."""
    for dtype, runs in spans.items():
        ws, wc = server.arrays[dtype], client.arrays[dtype]
        for run in runs:
            if weight == 1.0:  # exact replacement, without rounding
                ws[run].copy_(wc[run])
            else:
                ws[run].lerp_(wc[run], weight)


def scratch(state: RuleState, key: str, like: torch.Tensor) -> torch.Tensor:
    """A buffer shaped like ``like`` kept in ``state.work`` under ``key`` (contents undefined).

    A parameter-sized temporary per merge (``ws - wc``) is fresh memory each time once the
    allocator has returned the last one to the system, and on a VM fresh memory is slow to
    touch: the default rule's step took 12-17 ms for 5M parameters with a temporary, 4 ms with this.
    """
    buf = state.work.get(key)
    if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
        buf = state.work[key] = torch.empty_like(like)
    return buf


def zeros_like(params: FlatParams) -> FlatParams:
    return FlatParams(params.layout, {d: torch.zeros_like(a) for d, a in params.arrays.items()})


def copy_non_float(server: FlatParams, client: FlatParams) -> None:
    """Integer and boolean state (e.g. BatchNorm's ``num_batches_tracked``) takes the client's value."""
    for dtype, ws in server.arrays.items():
        if not ws.is_floating_point():
            ws.copy_(client.arrays[dtype])


def lerp(server: FlatParams, client: FlatParams, weight: float) -> None:
    """``server <- (1 - weight) * server + weight * client`` in place (``weight = 1 - alpha``)."""
    for dtype, ws in floats(server).items():
        wc = client.arrays[dtype]
        if weight == 1.0:  # exact replacement, without rounding
            ws.copy_(wc)
        elif weight != 0.0:
            ws.lerp_(wc, weight)
    copy_non_float(server, client)
