"""What a run's shell does for its core (the effects :func:`~vcdask.engine.core.handle` returns, carried out
in order by :mod:`vcdask.engine.run`), and why a run fails (:class:`Failure`).

An effect whose outcome the core needs (a merge, a commit, a result read back) comes back to it as an event
(:mod:`.messages`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..events import EventKind
from ..inflight import TaskRecord

__all__ = [
    "Cancel",
    "Commit",
    "DropUpdate",
    "Effect",
    "Emit",
    "Fail",
    "Failure",
    "FailureKind",
    "Merge",
    "Read",
    "Reply",
    "RunFailed",
    "Skip",
    "Submit",
]


#: Why a run failed: no usable worker for ``no_worker_timeout``, a shard given up under
#: ``on_shard_failure="stop"``, a task's own error, the store out for ``store_outage_timeout``, or
#: nothing left to run or wait for while an epoch is incomplete.
FailureKind = Literal["no_workers", "shard", "task", "store", "stuck"]

#: The error type each kind is reported as (the run's ``error`` starts with it, as a traceback's last line does).
_NAMES: dict[str, str] = {
    "no_workers": "NoWorkersError",
    "shard": "RuntimeError",
    "task": "RuntimeError",
    "store": "StoreOutageError",
    "stuck": "RuntimeError",
}


@dataclass(frozen=True)
class Failure:
    """Why a run fails: a ``kind`` and a message (``error``: the task's exception, for a task that raised)."""

    kind: FailureKind
    message: str
    error: BaseException | None = field(default=None, compare=False)

    def __str__(self) -> str:
        text = f"{_NAMES[self.kind]}: {self.message}"
        if self.error is not None:
            import traceback

            text = "".join(traceback.format_exception(self.error)) + "\n" + text
        return text


class RunFailed(RuntimeError):
    """Raised by the shell when it carries out a :class:`Fail` effect (ends the run's driver)."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.failure = failure


@dataclass(frozen=True)
class Submit:
    """Send a task: ``kind`` "update" trains a shard copy (``args``: epoch, shard, attempt, base version,
    base step, position), "validation" validates a version (``args``: version, step)."""

    key: str
    kind: Literal["update", "validation"]
    args: tuple[Any, ...]
    where: dict[str, Any] = field(default_factory=dict)
    priority: int = 0


@dataclass(frozen=True)
class Cancel:
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Read:
    """Read back the record of finished task ``key`` (then :class:`~.messages.Result`,
    :class:`~.messages.TaskFailed` or :class:`~.messages.Lost`)."""

    key: str
    task: TaskRecord


@dataclass(frozen=True)
class Merge:
    """Merge (or turn down) a shard result in the merge thread (then :class:`~.messages.Merged`)."""

    task: TaskRecord
    record: dict[str, Any]
    completes: bool
    max_staleness: int | None
    in_use_step: int
    ahead: str | None = None


@dataclass(frozen=True)
class Commit:
    """Commit the merges not in a version yet (then :class:`~.messages.Committed`)."""


@dataclass(frozen=True)
class DropUpdate:
    """Delete an update from the store (the merge thread's side: in order with the merges)."""

    path: str


@dataclass(frozen=True)
class Skip:
    """Record in the run's progress (the merge thread's side, so the next commit stores it) that
    (epoch, shard) was given up; ``end_step``: the step at which that completed the epoch, if it did."""

    epoch: int
    shard: int
    end_step: int | None


@dataclass(frozen=True)
class Emit:
    """Publish an event to the run's followers (:class:`~vcdask.engine.events.EventLog`)."""

    kind: EventKind
    fields: dict[str, Any]


@dataclass(frozen=True)
class Fail:
    """The run fails, for ``failure``."""

    failure: Failure


@dataclass(frozen=True)
class Reply:
    """The answer to the caller of the event (a preemption, a re-issue)."""

    value: Any


Effect = Submit | Cancel | Read | Merge | Commit | DropUpdate | Skip | Emit | Fail | Reply
