"""Merge rules: how the server folds one client update ``W_c`` into ``W_s``, as it arrives.

A rule is a small object with pure functions over flat parameters (one 1-D tensor per dtype):
``init_state(server)`` gives its state (e.g. a momentum buffer, as :class:`FlatParams` laid out
like the server parameters, plus JSON scalars), ``apply(server, client, state, arrival)``
changes ``server`` and ``state`` in place, and ``for_run(...)`` fills in the defaults a rule
leaves to the run.  The state is committed with every version (the store's ``/rule/<name>``
groups and the version's metadata), so a resumed run continues exactly.

Floating-point vectors are merged; integer and boolean state (e.g. BatchNorm's
``num_batches_tracked``) cannot be averaged and takes the client's value, for every rule.  Float
buffers (BatchNorm's running statistics: the layout's ``buffers``) are averaged, never extrapolated:
the rules that step past the update (``"nesterov"``, ``"probe"``, so ``"auto"``) give them no step
and no momentum, and take ``1 / (staleness + 1)`` of the client's; the others average every float
entry already.

Rules by name (``fit(..., merge=...)``), one per module:

``"vc-asgd"``
    The paper's rule, ``W_s <- alpha W_s + (1 - alpha) W_c``, alpha constant or scheduled.
``"staleness"``
    FedAsync (Xie et al. 2019): the client's weight ``(1 - alpha) * s(staleness)`` shrinks with
    the update's staleness; ``s(t) = (t + 1) ** -a`` or a hinge.
``"nesterov"``
    An outer optimizer (DiLoCo, Douillard et al. 2023): pseudo-gradient ``g = W_s - W_c``, one
    SGD step with Nesterov momentum per arrival or per ``delay`` arrivals.
``"sync"``
    DeDLOC-style large batch: collect updates until ``target_samples`` samples, then replace
    ``W_s`` by their sample-weighted mean at once.
``"probe"``
    The step sized per merge: ``W_s += (a (W_c - W_base) + b (W_base - W_s)) / (staleness + 1)``,
    ``(a, b)`` the candidates' lowest training loss on a fixed sample of rows (the server's probe).
``"auto"``
    ``"probe"`` where the server can afford its probe next to the tasks, else delayed Nesterov: chosen
    at the first merge, from the probe's measured time.  ``fit``'s default for 4 or more tasks in flight.
"""

from __future__ import annotations

from collections.abc import Callable

from .._ints import is_real
from ..errors import UnknownMergeRuleError
from ..schedules import check_alpha
from ._base import Arrival, MergeRule, RuleState, lerp
from .auto import Auto
from .nesterov import Nesterov
from .probe import Probe
from .staleness import Staleness
from .sync import Sync
from .vcasgd import VCASGD, vc_asgd

__all__ = [
    "DEFAULT_RULE",
    "ONE_IN_FLIGHT",
    "VCASGD",
    "Arrival",
    "Auto",
    "MergeRule",
    "Nesterov",
    "Probe",
    "RuleState",
    "Staleness",
    "Sync",
    "UnknownMergeRuleError",
    "for_run",
    "get_rule",
    "lerp",
    "rules",
    "vc_asgd",
]

#: Registered rules by name.
rules: dict[str, type[MergeRule]] = {r.name: r for r in (VCASGD, Staleness, Nesterov, Sync, Probe, Auto)}

#: The rule ``vcdask.fit`` uses when neither ``merge`` nor ``alpha`` is given: delayed Nesterov
#: (one momentum step per tasks-in-flight arrivals) with lr 0.5, momentum 0.9 and the momentum's bias
#: correction (issue 12; was lr 0.5, momentum 0.8 without it).  Chosen by ``benchmarks/defaults.py``
#: over four tasks, the one setting measured within the bar on all four (digits, the wide CNN, a
#: tabular task, the char-LM); lr 1.0 / momentum 0.9 met it on three but swung more from seed to seed.
#: See the docs' merge-rules page.
DEFAULT_RULE = Nesterov(lr=0.5, momentum=0.9, bias_correction="trust")

#: What :data:`DEFAULT_RULE` becomes for a run that keeps one task in flight (one worker thread): each
#: update weighs ``1 / (staleness + 1)``, so an update based on the newest version replaces ``W_s`` (one
#: worker is then a sequence of local runs, plain torch's loop), and one based on an older version (a
#: worker that joined, a re-issued copy) is averaged in.  An outer step on top of one worker's own
#: progress only extrapolates it: the delayed Nesterov default cost the small char-LM 8.7% of loss at
#: equal tokens with one worker, this rule 0.3% (issue 38; see the docs' merge-rules page).
ONE_IN_FLIGHT = Staleness(alpha=0.0, a=1.0)

_ALPHA_RULES = (VCASGD, Staleness)


def get_rule(
    merge: str | MergeRule | None = None,
    alpha: float | str | Callable[[int], float] | None = None,
    samples_per_epoch: int | None = None,
) -> MergeRule:
    """The rule for ``fit(merge=..., alpha=...)``: a name or an instance (as xarray's ``engine=``).

    Parameters
    ----------
    merge : str or MergeRule, optional
        Default: ``"vc-asgd"`` when ``alpha`` is given, else :data:`DEFAULT_RULE`.
    alpha : float, "epoch" or callable, optional
        For ``"vc-asgd"`` and ``"staleness"`` given by name.
    samples_per_epoch : int, optional
        Passed to :meth:`MergeRule.for_run`.

    Raises
    ------
    UnknownMergeRuleError
        An unknown name (the message lists the registered ones).
    ValueError
        ``alpha`` given with a rule that has none, or a bad alpha.
    TypeError
        ``merge`` is neither a name nor a :class:`MergeRule`.
    """
    if merge is None:
        merge = "vc-asgd" if alpha is not None else DEFAULT_RULE
    if isinstance(merge, MergeRule):
        if alpha is not None:
            raise ValueError(f"alpha={alpha!r} was given with a MergeRule instance ({merge.name}): set it on the rule")
        rule = merge
    elif isinstance(merge, str):
        cls = rules.get(merge)
        if cls is None:
            raise UnknownMergeRuleError(
                f"unknown merge rule {merge!r}; choose one of {sorted(rules)} or pass a vcdask.merge.MergeRule instance"
            )
        if alpha is None:
            rule = cls()
        elif cls not in _ALPHA_RULES:
            raise ValueError(
                f"alpha={alpha!r} does not apply to merge={merge!r} (only to 'vc-asgd' and "
                "'staleness'); configure the rule with an instance, e.g. vcdask.merge.Nesterov(lr=0.5)"
            )
        else:
            if is_real(alpha):
                check_alpha(float(alpha))
            rule = cls(alpha=alpha)  # type: ignore[call-arg]
    else:
        raise TypeError(f"merge must be a rule name {sorted(rules)} or a MergeRule, got {type(merge).__name__}")
    return rule.for_run(samples_per_epoch=samples_per_epoch)


def for_run(rule: MergeRule, *, in_flight: int, samples_per_epoch: int | None = None) -> MergeRule:
    """``rule`` as a run of ``in_flight`` tasks at once uses it (:meth:`MergeRule.for_run`), and
    :data:`DEFAULT_RULE` by the tasks in flight: :data:`ONE_IN_FLIGHT` for one, itself for 2 or 3, and
    :class:`Auto` over it for 4 or more (the probe rule where the server can afford its probe)."""
    if rule is DEFAULT_RULE:
        if in_flight == 1:
            return ONE_IN_FLIGHT
        rule = Auto(fallback=DEFAULT_RULE)
    return rule.for_run(samples_per_epoch=samples_per_epoch, in_flight=in_flight)
