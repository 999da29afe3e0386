"""What a finished run's own numbers say: did it give shards up, and, when nothing validated it, did the
training diverge?

A run without validation data ends with ``metrics == {}``; a run whose learning rate is far too high
ends "normally" too (``fit(model, (X, y), lr=10)`` on digits: epoch 1's training loss 504, one class
predicted for everything).  As Keras's ``TerminateOnNaN`` and Lightning's NaN checks do, vcdask looks
at the training loss it has anyway: :func:`divergence` names a run whose loss rose far above where it
started, or whose updates came back non-finite, and :class:`~vcdask.FitResult` warns with it
(``RuntimeWarning``) and keeps it in ``FitResult.notes``.

Where it started: the loss of the first local step of the tasks that trained from the run's initial
version (each task records its first step's loss, ``first_loss`` in ``FitResult.history``), measured
at the initial weights on training batches, at no extra cost.
"""

from __future__ import annotations

import math
from typing import Any

from ._stack import user_level

__all__ = ["DIVERGED_FACTOR", "NOT_VALIDATED", "SKIPS_LISTED", "annotate", "divergence", "given_up"]

#: A last epoch's mean training loss this many times the loss at the initial weights is divergence.
DIVERGED_FACTOR = 3.0

#: What a result without validation says about its metrics.
NOT_VALIDATED = (
    "not validated: no validation data, so metrics is empty and nothing checked the model on held-out "
    "samples; pass validation=0.1 to hold out 10% of the training data, or validation=(X_val, y_val)"
)


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def divergence(history: Any, epochs: Any) -> str | None:
    """Why the training looks diverged, in words, or None.

    Parameters
    ----------
    history, epochs : pandas.DataFrame
        ``FitResult.history`` and ``FitResult.epochs``.
    """
    if not len(history):
        return None
    rejected = history[history["outcome"] == "rejected"]
    # (updates rejected, not the rows of the shards given up for them: those name the same failures)
    non_finite = int(rejected["reason"].astype(str).str.contains("non-finite", regex=False).sum())
    merged = history[history["accepted"].astype(bool)]
    if non_finite and non_finite >= len(merged):
        return (
            f"{non_finite} updates came back non-finite (NaN/inf) and were rejected, against {len(merged)} "
            "merged: the training diverges (a learning rate too high?) or the loss is undefined on some samples"
        )
    if not len(merged) or not len(epochs) or "first_loss" not in merged:
        return None
    first = merged[merged["base_version"] == merged["base_version"].min()]["first_loss"]
    first = first[first.map(_finite)]
    last = epochs["train_loss"].iloc[-1]
    if not len(first) or not _finite(last):
        return None
    start = float(first.median())
    if start > 0 and float(last) > DIVERGED_FACTOR * start:
        epoch = epochs.index[-1] if epochs.index.name == "epoch" else len(epochs)
        return (
            f"the training loss rose from {start:.4g} (the first local steps, at the initial weights) to "
            f"{float(last):.4g} (epoch {epoch}'s mean): the training diverged; lower the learning rate "
            "(lr=, or the optimizer's) and validate (validation=0.1) to see it per epoch"
        )
    return None


#: The columns every epoch row has; any other is a validation metric.
_EPOCH_COLUMNS = {"epoch", "version", "wall_time", "train_loss", "skipped"}


#: How many given-up shards :func:`given_up` names.
SKIPS_LISTED = 5


def given_up(history: Any, epochs: Any = None) -> str | None:
    """The shards a run gave up (``on_shard_failure="skip"``), in words, or None.

    Parameters
    ----------
    history : pandas.DataFrame
        ``FitResult.history``.
    epochs : pandas.DataFrame, optional
        ``FitResult.epochs``: its ``skipped`` counts include the shards an earlier session of a resumed
        run gave up, which this session's history does not list.
    """
    rows = history[history["outcome"] == "skipped"] if len(history) else history
    if len(rows):  # (a shard given up while a copy of it was being merged counts merged: it trained)
        merged = set(zip(*(history[history["accepted"].astype(bool)][c] for c in ("epoch", "shard")), strict=True))
        rows = rows[[(e, s) not in merged for e, s in zip(rows["epoch"], rows["shard"], strict=True)]]
    before = 0  # per epoch: skips its row counts beyond this session's history rows
    if epochs is not None and len(epochs) and "skipped" in epochs:
        numbers = epochs["epoch"] if "epoch" in epochs else epochs.index
        here = rows["epoch"].value_counts() if len(rows) else {}
        for epoch, count in zip(numbers, epochs["skipped"].fillna(0), strict=True):
            before += max(0, int(count) - int(here.get(epoch, 0)))
    if not len(rows) and not before:
        return None
    pairs = (
        [f"shard {int(s)} of epoch {int(e)}" for e, s in zip(rows["epoch"], rows["shard"], strict=True)]
        if len(rows)
        else []
    )
    if before:
        pairs.append(f"{before} in an earlier session")
    listed = ", ".join(pairs[:SKIPS_LISTED]) + (
        f" and {len(pairs) - SKIPS_LISTED} more" if len(pairs) > SKIPS_LISTED else ""
    )
    return (
        f"{len(rows) + before} shard(s) given up (on_shard_failure='skip'): {listed}; the model did not train on their "
        "samples in those epochs (history.query(\"outcome == 'skipped'\") says why)"
    )


def annotate(result: Any) -> None:
    """A :class:`~vcdask.FitResult`'s notes: shards given up; nothing validated, and a diverged training
    (also warned: there is no validation metric to show it)."""
    import warnings

    skipped = given_up(result.history, result.epochs)
    if skipped is not None:
        result.notes.append(f"skipped: {skipped}")
    if result.metrics or set(result.epochs.columns) - _EPOCH_COLUMNS:
        return
    result.notes.append(NOT_VALIDATED)
    diverged = divergence(result.history, result.epochs)
    if diverged is not None:
        result.notes.append(f"diverged: {diverged}")
        warnings.warn(f"run {result.run_id}: {diverged}", RuntimeWarning, stacklevel=user_level())
