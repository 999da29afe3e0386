"""The run's decisions as pure functions: deadlines, staleness, re-issue, retries, exclusion, targets.

Nothing here talks to Dask or the store, or keeps state: each function takes what it decides on
and returns the decision, so every rule of the engine can be tested without a cluster.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from ..merge._base import float_buffers, parameter_runs
from ..params import all_finite
from .directions import (
    HIGHER_IS_BETTER,
    LOWER_IS_BETTER,
    LOWER_IS_BETTER_WORDS,
    NEGATED_SCORERS,
    QUALIFIERS,
    known_direction,
    lower_is_better,
)
from .durations import median_of, total_of

if TYPE_CHECKING:
    from ..params import FlatParams
    from ..resilience import Resilience

__all__ = [
    "COLD_START_SECONDS",
    "HIGHER_IS_BETTER",
    "LOWER_IS_BETTER",
    "LOWER_IS_BETTER_WORDS",
    "NEGATED_SCORERS",
    "NEVER_STARTED",
    "QUALIFIERS",
    "Overdue",
    "after_failure",
    "base_wait",
    "check_update",
    "deadline",
    "exclusion",
    "fits_notice",
    "improved",
    "known_direction",
    "lower_is_better",
    "overdue",
    "reached",
    "staleness_limit",
    "work_fraction",
]

#: A derived deadline is at least this for a worker's first shard of a run (it also imports torch,
#: reads the run's spec and its rows).
COLD_START_SECONDS = 30.0
#: Patience with the first shards of a run, before any shard time is measured.
FIRST_SHARDS_SECONDS = 60.0
#: speed_adaptive: a worker within this ratio of the fastest one's speed trains whole shards (timing noise).
FULL_WORK_RATIO = 0.8
#: speed_adaptive: the smallest share of a shard's batches a task is given.
MIN_WORK_FRACTION = 0.1
#: The longest a task waits for each step of the merges before its base (see :func:`base_wait`), in
#: seconds: at least ``BASE_WAIT_MIN`` (a merge and commit of a small model on a loaded machine), at most
#: ``BASE_WAIT_MAX``.
BASE_WAIT_MIN = 0.5
BASE_WAIT_MAX = 5.0
#: ... and while no shard time is measured yet.
BASE_WAIT_FIRST = 1.0
#: ... and in all, at most this many times as long: with a wait of two median shard times a task takes
#: about three, and its deadline (:func:`deadline`, ``deadline_factor`` 4 of them) stays out of reach.
BASE_WAIT_STEPS = 2
#: Preemption notices (see :func:`fits_notice`): a running copy is let finish on a worker that got a
#: notice only if its expected remaining time, times ``NOTICE_SAFETY``, plus ``NOTICE_MARGIN`` seconds
#: fits the notice; the margin is also kept free at the end of the notice for the worker to retire.
NOTICE_SAFETY = 1.5
NOTICE_MARGIN = 5.0
#: validate_every="auto": validations may take at most this share of the time the run's shard tasks took
VALIDATION_SHARE = 0.05


def deadline(res: Resilience, shard_seconds: Sequence[float], tasks_per_slot: int, cold: bool = False) -> float:
    """Seconds a shard copy may run before a copy is re-issued elsewhere.

    An explicit ``res.deadline`` holds for every task.  Otherwise ``deadline_factor *
    tasks_per_slot * median(shard_seconds)``, at least ``deadline_floor``; at least
    :data:`COLD_START_SECONDS` on a ``cold`` worker (no shard of this run finished there yet);
    :data:`FIRST_SHARDS_SECONDS` while nothing has been measured.
    """
    if res.deadline is not None:
        return float(res.deadline)
    if not shard_seconds:
        return max(res.deadline_floor, FIRST_SHARDS_SECONDS)
    derived = max(res.deadline_floor, res.deadline_factor * tasks_per_slot * median_of(shard_seconds))
    return max(derived, COLD_START_SECONDS) if cold else derived


def base_wait(shard_seconds: Sequence[float]) -> float:
    """Seconds a task ready to train may wait for the next step of the merge path (a result settled, a
    version committed) while the results that came back before it are merged.

    One median shard time of the recent shards, within [:data:`BASE_WAIT_MIN`, :data:`BASE_WAIT_MAX`];
    :data:`BASE_WAIT_FIRST` while nothing has been measured.  A merge usually takes a small part of a
    task, so the wait is mostly far shorter.  The bound is on each step, not the whole wait
    (:meth:`~vcdask.engine.handshake.Handshake.settled_through`): when the merge thread is the
    bottleneck, the wait holds workers back until their turn instead of letting results queue up ever
    staler (``benchmarks/merge_queue.py``: 4 workers beside two busy loops on two cores, the probe rule's
    merged updates were 7.5 merges stale, at most 16, with the whole wait bounded by this; 3 with each
    step bounded, 2.8 points more accurate); a merge path that stops lets the task go on from the
    version there is, and so does a wait of :data:`BASE_WAIT_STEPS` times this in all.
    """
    if not shard_seconds:
        return BASE_WAIT_FIRST
    return min(BASE_WAIT_MAX, max(BASE_WAIT_MIN, statistics.median(shard_seconds[-64:])))


def staleness_limit(max_staleness: int | str | None, n_shards: int, in_flight: int) -> int | None:
    """The staleness limit in force: ``max_staleness`` itself, or for ``"auto"`` the larger of two
    epochs' worth of shards and four times the tasks in flight (healthy workers stay far below)."""
    if max_staleness == "auto":
        return max(2 * n_shards, 4 * in_flight)
    if isinstance(max_staleness, str):
        raise ValueError(f"max_staleness={max_staleness!r}: expected an integer, 'auto' or None")
    return max_staleness


@dataclass(frozen=True)
class Overdue:
    """The verdict on one shard copy in flight: re-issue it (``why``), and whether anyone is to blame."""

    why: str
    blame: bool = True


#: A copy that waited past its patience without starting: sent again, the one it replaces cancelled (at most
#: one such copy of a shard or a validation waits at a time).
NEVER_STARTED = Overdue("never started")


def overdue(
    *,
    now: float,
    submitted: float,
    started: float | None,
    running_on: str | None,
    worker: str | None,
    behind: int,
    stale_after: int | None,
    limit: float,
    patience: float,
    room: bool = True,
    draining: bool = False,
) -> Overdue | Literal["restart"] | None:
    """Whether a shard copy in flight must be re-issued.

    Parameters
    ----------
    now, submitted, started : float
        Monotonic clock; ``started`` is None until the task reported that it runs.
    running_on : str or None
        The worker Dask has the task processing on now.
    worker : str or None
        The worker the task reported running on.
    behind : int
        Merges since the copy's base version (0 for a copy that has not asked for its base yet: it will
        train from the newest version).
    stale_after : int or None
        The staleness limit in force.
    limit : float
        The copy's deadline once started.
    patience : float
        How long a copy may wait to start.
    room : bool
        Whether a usable worker has a thread running no task.  A copy that never started is sent again only
        then: while every thread is busy (another client's tasks) a second copy would wait as well, and a
        copy every so often piled up without bound.
    draining : bool
        Whether ``worker`` is draining under a preemption notice.  A copy running there was let finish
        inside the notice's window (:mod:`vcdask.engine.core.watching` re-issues it, without blame, when only
        the margin is left), so the deadline does not apply to it: a reclaimed instance is often
        throttled, and its last shard is not the worker's failure.

    Returns
    -------
    Overdue, "restart" or None
        ``"restart"``: its worker died and Dask is moving it (its clock starts afresh).
    """
    if stale_after is not None and behind > stale_after:
        # its result could only be rejected as stale: a fresh copy now, nobody blamed
        return Overdue(f"fell {behind} merges behind (max_staleness={stale_after})", blame=False)
    if started is not None and now - started > limit:
        if running_on != worker:
            return "restart"
        if draining:
            return None
        return Overdue(f"ran past its {limit:.1f} s deadline")
    if started is None and now - submitted > patience and room:
        return NEVER_STARTED
    return None


def after_failure(failures: int, res: Resilience) -> Literal["retry", "skip", "stop"]:
    """What to do with a shard copy that failed, given the shard's failures so far in its epoch."""
    if failures < res.max_attempts:
        return "retry"
    return "stop" if res.on_shard_failure == "stop" else "skip"


def exclusion(failed: int, timed_out: int, rejected: int, res: Resilience) -> str | None:
    """Why a worker gets no more shards (None while it may): too many faults."""
    if failed + timed_out + rejected < res.max_worker_failures:
        return None
    return (
        f"{failed} failed, {timed_out} timed out, {rejected} rejected (max_worker_failures={res.max_worker_failures})"
    )


def reached(name: str, goal: float, value: float | None) -> bool:
    """Whether a metric ``value`` meets ``goal`` (at most for losses and errors, at least otherwise)."""
    if value is None:
        return False
    return value <= goal if lower_is_better(name) else value >= goal


def improved(name: str, value: float | None, best: float | None) -> bool:
    """Whether ``value`` of metric ``name`` is strictly better than ``best`` (None: nothing yet; a NaN
    value never improves)."""
    if value is None or math.isnan(value):
        return False
    if best is None or math.isnan(best):
        return True
    return value < best if lower_is_better(name) else value > best


def check_update(
    server: FlatParams, client: FlatParams, *, staleness: int, max_staleness: int | None, max_norm: float | None
) -> tuple[str, str] | None:
    """Why an update must not be merged, as ``(kind, reason)``, or None when it is fine.

    ``kind`` is ``"layout"``, ``"non-finite"``, ``"stale"`` or ``"norm"``; all but ``"stale"`` are the
    worker's fault.
    """
    if client.layout != server.layout:
        return "layout", "layout mismatch: " + "; ".join(server.layout.diff(client.layout)[:4])
    floats = {d: c for d, c in client.arrays.items() if c.is_floating_point()}
    bad = []
    if not all(all_finite(c) for c in floats.values()):  # names only when needed
        bad = [n for n, v in client.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        return "non-finite", f"non-finite values (NaN/inf) in {bad[:4]}{' ...' if len(bad) > 4 else ''}"
    if max_staleness is not None and staleness > max_staleness:
        return "stale", f"stale: based on a version {staleness} merges old (max_staleness={max_staleness})"
    if max_norm is not None:  # over the parameters: the float buffers (BatchNorm's statistics) take no step
        spans = float_buffers(server, client)
        norm = math.hypot(
            *(
                float(torch.dist(c[run].float(), server.arrays[d][run].float()))
                for d, c in floats.items()
                for run in parameter_runs(c.numel(), spans.get(d, []))
            )
        )
        if norm > max_norm:
            return "norm", f"update norm ||W_c - W_s|| = {norm:.4g} > max_update_norm={max_norm:.4g}"
    return None


def work_fraction(step_seconds: float, fastest: float) -> float:
    """The share of a shard's batches a task trains when work is sized to speed (``speed_adaptive``).

    A worker that takes ``step_seconds`` per training step, where the fastest usable worker takes
    ``fastest``, is given ``fastest / step_seconds`` of its shard (the dynamic local updates of
    Asynchronous Local-SGD, Liu et al. 2024): its task takes about as long as the fastest worker's,
    so its update is no staler.  Workers within :data:`FULL_WORK_RATIO` of the fastest, and workers
    not measured yet, train whole shards; no task gets less than :data:`MIN_WORK_FRACTION`.
    """
    if not (step_seconds > 0 and fastest > 0):  # not measured (nan) yet
        return 1.0
    ratio = fastest / step_seconds
    if ratio >= FULL_WORK_RATIO:
        return 1.0
    return max(MIN_WORK_FRACTION, ratio)


def fits_notice(expected: float, elapsed: float, window: float) -> bool:
    """Whether a shard copy that has run ``elapsed`` of its ``expected`` seconds finishes inside a
    preemption notice of ``window`` seconds: its remaining time, times :data:`NOTICE_SAFETY`, plus
    :data:`NOTICE_MARGIN` (its upload, the result's hand-over, the worker's retirement)."""
    remaining = max(0.0, expected - elapsed)
    return remaining * NOTICE_SAFETY + NOTICE_MARGIN <= window


def validation_due(
    validate_every: int | str, step: int, validation_seconds: Sequence[float], shard_seconds: Sequence[float]
) -> bool:
    """Whether the version committed at merge ``step`` is validated (an epoch's last one always is).

    An int ``k``: every ``k``-th merge.  ``"auto"``: when the validations so far (the epochs' ends
    included) and one more would take at most :data:`VALIDATION_SHARE` of the time the merged shard
    tasks took, so validating stays off the training path: a validation takes a worker's slot as a
    shard task does.  One more is taken to last as long as the median validation so far, or before
    any came back, as the median shard task.  On the char-LM of ``benchmarks/utilization.py`` (one
    worker, 16 tasks of 1.4 s) validating every merge took a third of the worker's time.
    """
    if validate_every != "auto":
        return step % int(validate_every) == 0
    if not shard_seconds:
        return False
    one_more = median_of(validation_seconds or shard_seconds)
    return total_of(validation_seconds) + one_more <= VALIDATION_SHARE * total_of(shard_seconds)
