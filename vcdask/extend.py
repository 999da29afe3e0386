"""Extending a run: ``resume(run_id, max_epochs=N)`` checked against what the run has done (before any cluster work),
what the longer run does to a schedule over the run's steps (said, as a warning), and the new number kept in the
run's spec.  Used by :func:`vcdask.resume`.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

from ._stack import user_level
from .engine.end import progress_of
from .lr_schedules import RunSchedule, run_steps
from .spec import loads, save_spec, spec_path
from .store import ParamStore

logger = logging.getLogger(__name__)

__all__ = ["check_extend", "epochs_done", "keep_max_epochs", "schedule_restart"]


def epochs_done(store: ParamStore, run_id: str) -> int:
    """How many epochs of the run are complete, from its progress (:func:`vcdask.engine.end.progress_of`: an
    epoch a shard given up ended after the last commit is in the run's record)."""
    versions = store.versions(run_id)
    if not versions:
        return 0
    return len(progress_of(store, run_id, versions[0].id, versions[0].metadata).get("done", []))


def check_extend(store: ParamStore, run_id: str, max_epochs: int) -> None:
    """Check ``max_epochs`` against what the run has done (before any cluster work); warn when the run's
    :class:`~vcdask.lr_schedules.RunSchedule` starts again part way up (:func:`schedule_restart`).

    Raises
    ------
    ValueError
        ``max_epochs`` is not more than the epochs the run has done (both named).
    """
    done = epochs_done(store, run_id)
    if max_epochs <= done:
        raise ValueError(
            f"max_epochs={max_epochs} would not extend run {run_id!r}: it has done {done} epochs already; "
            f"pass max_epochs > {done} (the total number of epochs, not the number to add)"
        )
    logger.info("run %s: %d epochs done, training up to %d", run_id, done, max_epochs)
    note = schedule_restart(loads(store.files.get(spec_path(run_id)), store), done, max_epochs)
    if note is not None:
        warnings.warn(f"run {run_id}: {note}", UserWarning, stacklevel=user_level())


def schedule_restart(spec: Any, done: int, max_epochs: int) -> str | None:
    """What extending a run of ``spec`` from ``done`` epochs to ``max_epochs`` does to its learning-rate schedule,
    or None when nothing changes (no schedule over the run, or one whose factor goes on as it was).

    A :class:`~vcdask.lr_schedules.RunSchedule` spans ``max_epochs`` passes (:func:`~vcdask.lr_schedules.run_steps`):
    the extended run's schedule is the one a run of ``max_epochs`` would have had, so a decay that had ended comes
    back part way up (``Cosine()`` from 2 epochs to 4: from about 0 to 0.5 at the third epoch's first step) and
    decays again to its end.  The message gives both factors, and what to do for a schedule of the added epochs'
    own.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> from vcdask.data import Shards
    >>> from vcdask.lr_schedules import Cosine
    >>> spec = SimpleNamespace(lr_schedule=Cosine(), shards=Shards(64, 2), batch_size=32, local_epochs=1, max_epochs=2)
    >>> print(schedule_restart(spec, 2, 4))  # doctest: +NORMALIZE_WHITESPACE
    lr_schedule=Cosine(warmup=0.0, final=0.0) spans the run's max_epochs passes, so from 2 epochs to 4 it is a
    4-epoch run's: its factor, 0.146 at the run's last step, is 0.5 at epoch 3's first. For the added epochs on
    a schedule of their own, start a run from this one's model instead: vcdask.fit(result.model, data,
    lr_schedule=...)
    """
    schedule = getattr(spec, "lr_schedule", None)
    if not isinstance(schedule, RunSchedule):
        return None
    per_shard, total = run_steps(spec)
    longer = (
        dataclasses.replace(spec, max_epochs=max_epochs)
        if dataclasses.is_dataclass(spec) and not isinstance(spec, type)
        else None
    )
    if longer is None:  # (a stand-in spec: the steps scale with max_epochs)
        new_total = round(total / spec.max_epochs * max_epochs)
    else:
        new_total = run_steps(longer)[1]
    at = round(done * spec.shards.n_shards * per_shard)  # the added epochs' first step
    last, first = float(schedule(max(at - 1, 0), total)), float(schedule(at, new_total))
    if abs(first - last) <= 1e-6 * max(1.0, abs(last)):
        return None
    return (
        f"lr_schedule={schedule!r} spans the run's max_epochs passes, so from {done} epochs to {max_epochs} it is a "
        f"{max_epochs}-epoch run's: its factor, {last:.3g} at the run's last step, is {first:.3g} at epoch "
        f"{done + 1}'s first. For the added epochs on a schedule of their own, start a run from this one's model "
        "instead: vcdask.fit(result.model, data, lr_schedule=...)"
    )


def keep_max_epochs(store: ParamStore, run_id: str, max_epochs: int) -> None:
    """Keep the run's new ``max_epochs`` in its spec (a later plain ``resume`` trains up to it), in ``store``: the
    spec read from it is bound to it (:func:`vcdask.spec.bind`), wherever it was written."""
    spec = loads(store.files.get(spec_path(run_id)), store)
    if spec.max_epochs != max_epochs:
        save_spec(dataclasses.replace(spec, max_epochs=max_epochs))
