"""What a run keeps about each task it handed out, and the rows of its history.

``FitResult.history`` has one row per shard-task outcome: merged, rejected (with the reason), late,
lost with a worker, cancelled, skipped or failed on the store.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TaskRecord", "history_row"]


@dataclass
class TaskRecord:
    """A shard or validation task in flight (the run's event loop only)."""

    kind: str  # "update" or "validation"
    epoch: int = 0
    shard: int = 0
    attempt: int = 0
    step: int = 0
    version: str | None = None  # the version a validation task measures
    submitted: float = 0.0
    started: float | None = None  # reported by the task when it begins to run
    worker: str | None = None
    overdue: bool = False  # a copy was re-issued because this one missed its deadline (or was stuck)


def history_row(epoch: int, shard: int, attempt: int, **kw) -> dict:
    """One row of ``FitResult.history``: every column, with ``kw`` filled in."""
    row = {"epoch": epoch, "shard": shard, "attempt": attempt, "worker": None, "update": None,
           "base_version": None, "new_version": None, "version_id": None, "alpha": None, "staleness": None,
           "train_loss": float("nan"), "seconds": float("nan"), "read_seconds": float("nan"),
           "train_seconds": float("nan"), "upload_seconds": float("nan"), "accepted": False, "reason": None,
           "time": None}
    row.update(kw)
    return row
