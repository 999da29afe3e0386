"""Option groups of :func:`vcdask.fit`: how updates merge (:class:`Merging`), how each shard task trains
(:class:`Training`) and when a run stops and validates (:class:`Stopping`), beside :class:`~vcdask.Resilience`
and :class:`~vcdask.Retention`.

Each group is a frozen dataclass that checks itself when it is made (the errors name the bad value and the
valid choices).  ``fit`` keeps every option flat too; :func:`fold` puts the flat ones into their group, so
that :func:`vcdask.options.plan` sees the groups alone.  As Ray Train's ``ScalingConfig`` / ``RunConfig``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self, TypeVar

import torch

from ._ints import check_bool, is_real, positive_int
from ._targets import check_target
from .compress import check_compression
from .device import check_device, check_precision
from .holdout import check_early_stopping
from .inner import check_optimizer_state, check_schedule
from .merge import MergeRule, get_rule

if TYPE_CHECKING:
    from .lr_schedules import RunSchedule

__all__ = ["GROUPS", "RENAMED", "Merging", "Stopping", "Training", "check_optimizer", "fold", "fold_options"]


def check_optimizer(optimizer: Any) -> None:
    """Raise unless ``optimizer`` is None, a ``torch.optim.Optimizer`` subclass or a callable.

    Raises
    ------
    TypeError
        Naming the type given.
    """
    if optimizer is None or callable(optimizer):  # (a class is callable)
        return
    how = "optimizer must be a torch.optim.Optimizer class or a callable params -> optimizer"
    if isinstance(optimizer, torch.optim.Optimizer):  # built on the caller's model: each worker builds its own
        cls = f"torch.optim.{type(optimizer).__name__}" if _in_torch(type(optimizer)) else type(optimizer).__name__
        raise TypeError(
            f"{how}, got an optimizer built already ({cls} of the model given here): each worker builds its own on "
            f"its copy of the model, so pass the class, optimizer={cls} (lr= sets its learning rate), or "
            f"functools.partial({cls}, momentum=0.9) for its other settings"
        )
    if isinstance(optimizer, str):
        named = {n.lower(): n for n in dir(torch.optim) if _in_torch(getattr(torch.optim, n))}
        found = named.get(optimizer.lower().replace("_", ""))
        cls, which = (f"torch.optim.{found}", "the class") if found else ("torch.optim.Adam", "a class, e.g.")
        raise TypeError(
            f"{how}, got str {optimizer!r} (a name): pass {which} optimizer={cls} (lr= sets its learning rate), or "
            f"functools.partial({cls}, weight_decay=0.01) for its other settings"
        )
    raise TypeError(f"{how}, got {type(optimizer).__name__}")


def _in_torch(cls: Any) -> bool:
    """Whether ``cls`` is one of torch's optimizer classes (``torch.optim.SGD``)."""
    return isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls.__module__.startswith("torch.optim")


def _every(name: str, value: Any) -> int | str:
    """``commit_every`` / ``validate_every``: ``"auto"`` or an integer >= 1."""
    return "auto" if value == "auto" else positive_int(name, value, also="'auto'")


class _RemembersGiven:
    """What a group was given when it was made: the fields passed by name or position (``_given``, beside the
    fields: not compared, not shown, pickled with the group), so that :func:`fold` refuses a flat option whose
    field the group was given, at its default value too (``Training(lr=1e-3)`` with ``lr=0.1``)."""

    _given: frozenset[str]

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        self = super().__new__(cls)
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        given = {*names[: len(args)], *kwargs}
        if not args and given == set(names):
            # every field by name: dataclasses.replace's call, which passes the fields it copies with those it
            # changes; given are those off their defaults
            defaults = {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
            given = {n for n in names if not _is_default(kwargs[n], defaults[n])}
        object.__setattr__(self, "_given", frozenset(given))
        return self


def given_fields(group: Merging | Training | Stopping) -> frozenset[str]:
    """The fields ``group`` sets: those it was given when it was made, and those off their defaults (all a group
    pickled by an earlier release, which did not record what it was given, can say)."""
    off = {f.name for f in dataclasses.fields(group) if not _is_default(getattr(group, f.name), f.default)}
    return frozenset(off) | getattr(group, "_given", frozenset())


@dataclass(frozen=True)
class Merging(_RemembersGiven):
    """How the server folds each update in: the rule, and how often it commits and what it is sent.

    Parameters
    ----------
    rule : {"vc-asgd", "staleness", "nesterov", "sync", "probe", "auto"} or vcdask.merge.MergeRule, optional
        ``fit(merge=...)``.  Default: :data:`vcdask.merge.DEFAULT_RULE`, which the run makes
        :data:`~vcdask.merge.ONE_IN_FLIGHT` for one task in flight and :class:`~vcdask.merge.Auto` over it
        for 4 or more (:func:`vcdask.merge.for_run`), moving up as the fleet grows
        (:mod:`vcdask.engine.following`); ``"vc-asgd"`` when ``alpha`` is given (see
        :func:`vcdask.merge.get_rule`).
    alpha : float, "epoch" or callable, optional
        For ``"vc-asgd"`` and ``"staleness"`` given by name: the server copy's weight.
    commit_every : int or "auto", default 1
        Commit a version every this many merges (epoch ends always commit).
    compression : {None, "fp16", "bf16", "int8", "int4"}, optional
        Send each update as its difference from its base version in fewer bits (:mod:`vcdask.compress`).
    tasks_per_slot : int, default 1
        Shard tasks kept in flight per worker thread.
    speed_adaptive : bool, default False
        Size each task to its worker's measured speed.

    Raises
    ------
    UnknownMergeRuleError
        An unknown rule name (the message lists the registered ones).
    ValueError, TypeError
        Any other bad value; the message names it and the valid choices.

    Examples
    --------
    >>> Merging(rule="staleness", alpha=0.5)
    Merging(rule='staleness', alpha=0.5, commit_every=1, compression=None, tasks_per_slot=1, speed_adaptive=False)
    """

    rule: str | MergeRule | None = None
    alpha: float | str | Callable[[int], float] | None = None
    commit_every: int | str = 1
    compression: str | None = None
    tasks_per_slot: int = 1
    speed_adaptive: bool = False

    def __post_init__(self) -> None:
        get_rule(self.rule, self.alpha)  # a bad name or alpha, before any data is read
        if is_real(self.alpha):  # np.float32(0.5) too: a plain float from here on
            object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "commit_every", _every("commit_every", self.commit_every))
        object.__setattr__(self, "compression", check_compression(self.compression))
        object.__setattr__(self, "tasks_per_slot", positive_int("tasks_per_slot", self.tasks_per_slot))
        # (a truthy string would silently switch it on)
        object.__setattr__(self, "speed_adaptive", check_bool("speed_adaptive", self.speed_adaptive))


@dataclass(frozen=True)
class Training(_RemembersGiven):
    """How each shard task trains on its worker: the inner optimizer, its schedule and the step's numerics.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer subclass or callable, optional
        A class (made with ``lr``) or ``params -> optimizer``.  Default: Adam with learning rate ``lr``.
    lr : float, default 1e-3
        The learning rate of an optimizer given as a class (or of the default Adam).
    lr_schedule : callable or vcdask.lr_schedules.RunSchedule, optional
        Scales the learning rate at every local step.
    clip_grad_norm : float, optional
        Clip the gradients' total norm to this before every local step.
    precision : {"32", "bf16", "16-mixed"}, default "32"
    optimizer_state : {"auto", "fresh", "worker"}, default "auto"
        Whether a worker keeps its optimizer's state between its tasks (see :mod:`vcdask.inner`).
    local_epochs : int, default 1
        Passes over its shard that each task makes.
    batch_size : int, default 32
    device : {"auto", "cpu", "cuda", "cuda:N", "mps"} or torch.device, default "auto"
        Where each worker trains (kept as its string).

    Raises
    ------
    ValueError, TypeError
        A bad value; the message names it and the valid choices.

    Examples
    --------
    >>> Training(lr=0.05, batch_size=64).batch_size
    64
    >>> Training(device=torch.device("cpu")).device
    'cpu'
    """

    optimizer: type[torch.optim.Optimizer] | Callable[..., torch.optim.Optimizer] | None = None
    lr: float = 1e-3
    lr_schedule: Callable[[int, int], float] | RunSchedule | None = None
    clip_grad_norm: float | None = None
    precision: str = "32"
    optimizer_state: str = "auto"
    local_epochs: int = 1
    batch_size: int = 32
    device: str | torch.device = "auto"

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer)
        lr = self.lr
        if not is_real(lr) or not lr > 0 or math.isinf(lr):
            raise ValueError(f"lr must be a positive number, got {lr!r}")
        object.__setattr__(self, "lr", float(lr))
        check_schedule(self.lr_schedule)
        clip = self.clip_grad_norm
        if clip is not None:
            if not is_real(clip) or not clip > 0:
                raise ValueError(f"clip_grad_norm must be a positive number or None, got {clip!r}")
            object.__setattr__(self, "clip_grad_norm", float(clip))
        object.__setattr__(self, "precision", check_precision(self.precision))
        object.__setattr__(self, "optimizer_state", check_optimizer_state(self.optimizer_state))
        object.__setattr__(self, "local_epochs", positive_int("local_epochs", self.local_epochs))
        object.__setattr__(self, "batch_size", positive_int("batch_size", self.batch_size))
        object.__setattr__(self, "device", check_device(self.device))


@dataclass(frozen=True)
class Stopping(_RemembersGiven):
    """When a run stops early and how often it validates.

    Parameters
    ----------
    target : dict, optional
        Stop once the validation metrics of an epoch's last version reach it, e.g. ``{"accuracy": 0.95}``
        (the names are checked against the run's metrics when it is planned).
    patience : int, optional
        Stop once ``monitor`` has not improved for this many epochs.
    monitor : str, optional
        The validation metric early stopping and ``FitResult.best_version`` follow.
    validate_every : int or "auto", default "auto"
        Validate every this many merges, when that merge was committed (epoch ends always).

    Raises
    ------
    ValueError, TypeError
        A bad value; the message names it and the valid choices.

    Examples
    --------
    >>> Stopping(target={"accuracy": 0.9}, patience=3)
    Stopping(target={'accuracy': 0.9}, patience=3, monitor=None, validate_every='auto')
    """

    target: Mapping[str, float] | None = None
    patience: int | None = None
    monitor: str | None = None
    validate_every: int | str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", check_target(self.target))
        patience, _ = check_early_stopping(self.patience, self.monitor, None, [self.monitor or "loss"], False)
        object.__setattr__(self, "patience", patience)
        object.__setattr__(self, "validate_every", _every("validate_every", self.validate_every))


#: The groups ``fit`` takes, by their keyword (``merging=``, ``training=``, ``stopping=``).
GROUPS: dict[str, type[Merging] | type[Training] | type[Stopping]] = {
    "merging": Merging,
    "training": Training,
    "stopping": Stopping,
}
#: fit's flat arguments whose group field has another name.
RENAMED = {"merge": "rule"}

G = TypeVar("G", Merging, Training, Stopping)


def _flat_names(cls: type) -> dict[str, str]:
    """``fit``'s flat names of ``cls``'s fields: flat name -> field."""
    flat = {field: given for given, field in RENAMED.items()}
    return {flat.get(f.name, f.name): f.name for f in dataclasses.fields(cls)}


def _is_default(value: Any, default: Any) -> bool:
    # defaults are None, str, int, float or bool: == is safe between values of the same type
    return value is default or (type(value) is type(default) and value == default)


def fold(cls: type[G], group: G | None, **flat: Any) -> G:
    """``group`` (default ``cls()``) with ``fit``'s flat arguments of it folded in.

    A flat argument at its default leaves the group's field as it is; one that differs from it sets the
    field, unless the group was given that field too (at any value, its default included: ``lr=0.1`` with
    ``Training(lr=1e-3)`` is refused).  A group made by ``dataclasses.replace`` counts as given the fields it
    holds off their defaults (replace passes every field: it cannot say which it was told).

    Parameters
    ----------
    cls : type
        :class:`Merging`, :class:`Training` or :class:`Stopping`.
    group : cls, optional
        As given to ``fit`` (``merging=``, ``training=``, ``stopping=``).
    **flat
        ``fit``'s flat arguments of the group (``merge=`` for ``rule``), e.g. ``lr=0.05``.

    Returns
    -------
    cls
        Checked (the group's ``__post_init__`` ran on the flat values too).

    Raises
    ------
    TypeError
        ``group`` is not a ``cls``, a flat name is no option of it, or an option is given both flat and in
        the group (both named).

    Examples
    --------
    >>> fold(Training, Training(batch_size=64), lr=0.05, batch_size=32)  # doctest: +ELLIPSIS
    Training(optimizer=None, lr=0.05, ..., batch_size=64, device='auto')
    """
    name = cls.__name__.lower()
    if group is None:
        group = cls()
    elif not isinstance(group, cls):
        raise TypeError(f"{name} must be a vcdask.{cls.__name__}, got {type(group).__name__}")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    names = _flat_names(cls)
    given_in_group = given_fields(group)
    changes = {}
    for given, value in flat.items():
        field = names.get(given)
        if field is None:
            raise TypeError(f"{given} is not a flat option of vcdask.{cls.__name__}; its options: {list(names)}")
        if _is_default(value, defaults[field]):
            continue
        if field in given_in_group:
            raise TypeError(
                f"{given}={value!r} and {name}={cls.__name__}({field}={getattr(group, field)!r}) both set "
                f"{field}: pass it once, as {given}= or in {name}="
            )
        changes[field] = value
    return dataclasses.replace(group, **changes) if changes else group


def fold_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``fit``'s keywords given as a mapping (a job file's ``fit:``), its groups' flat options folded into
    ``merging=``, ``training=`` and ``stopping=`` (:func:`fold`); the other keywords as they are.

    Raises
    ------
    TypeError, ValueError
        As :func:`fold` and the groups' checks.
    """
    out = dict(options)
    for keyword, cls in GROUPS.items():
        names = _flat_names(cls)
        flat = {k: out.pop(k) for k in list(out) if k in names}
        out[keyword] = fold(cls, out.pop(keyword, None), **flat)  # type: ignore[arg-type]
    return out
