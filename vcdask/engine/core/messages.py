"""What goes into a run's core and what comes out: events in, effects out.

The core (:func:`~vcdask.engine.core.handle`) takes one event at a time and returns the effects the
run's shell (:mod:`vcdask.engine.run`) carries out, in order.  Every value here is small and plain:
keys, task records, a shard result's record (the update itself stays in the store), a server
:class:`~vcdask.engine.committing.Head`.  An effect whose outcome the core needs (a merge, a commit, a
result read back) comes back to it as another event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..committing import Head
from ..events import EventKind
from ..inflight import TaskRecord

__all__ = [
    "Cancel",
    "CloseEpochs",
    "Commit",
    "Committed",
    "Completed",
    "DropUpdate",
    "Effect",
    "Emit",
    "Event",
    "Fail",
    "Failure",
    "FailureKind",
    "Finish",
    "HandOver",
    "Idle",
    "Identified",
    "Joined",
    "Left",
    "Lost",
    "Merge",
    "Merged",
    "Poll",
    "Preempt",
    "Read",
    "Reissue",
    "Reply",
    "Result",
    "RunFailed",
    "Resumed",
    "Settle",
    "Skip",
    "Started",
    "Stop",
    "StoreBack",
    "StoreFault",
    "Submit",
    "TaskFailed",
    "Tick",
    "Validated",
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
    """Raised by the shell when it carries out a :class:`~.messages.Fail` effect (ends the run's driver)."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.failure = failure


# -- events: what happened -------------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    """Task ``key`` began to run on ``worker`` (its deadline counts from now), an ``instance`` bought on
    ``market`` (for the cost accounting), as far as the worker knows.  ``handed``: as far as the hand-over
    of the task before it on that worker knows (it went out with that answer; it may wait there behind
    other work, another run's or another user's, before it begins)."""

    key: str
    worker: str
    instance: str | None = None
    market: str | None = None
    handed: bool = False


@dataclass(frozen=True)
class HandOver:
    """A task sent its record as it finished (before Dask reports it done): its worker is free now;
    the record waits in the task table's ``handed`` queue for its merge."""

    key: str
    record: dict[str, Any]


@dataclass(frozen=True)
class Completed:
    """Dask reports task ``key`` done (``cancelled``: cancelled before it ran)."""

    key: str
    cancelled: bool = False


@dataclass(frozen=True)
class Result:
    """The record of a finished task, read back (``taken``: its worker was freed already, by a hand-over)."""

    task: TaskRecord
    record: dict[str, Any]
    taken: bool = False


@dataclass(frozen=True)
class TaskFailed:
    """A task raised (``error``): a store fault, a lost worker, or the task's own error."""

    task: TaskRecord
    error: BaseException


@dataclass(frozen=True)
class Lost:
    """A finished task's record could not be read back (its worker left and the store has no copy)."""

    task: TaskRecord
    why: str


@dataclass(frozen=True)
class Merged:
    """The merge thread merged (or turned down) ``record``: ``outcome`` is what
    :meth:`~vcdask.engine.params_server.ParamsServer.merge` returned; ``head``: the server after it."""

    task: TaskRecord
    record: dict[str, Any]
    outcome: dict[str, Any]
    head: Head


@dataclass(frozen=True)
class Committed:
    """The merges so far are committed: the server is at ``head``."""

    head: Head


@dataclass(frozen=True)
class Tick:
    """Time passed: deadlines, copies fallen behind, late validations.  ``workers``: what Dask says of each
    connected worker now (address -> (its status, its threads running no task)), read by the shell from the
    scheduler (None: not looked at): a worker Dask paused gets no shards, and a copy that never started is
    sent again only where a thread is free."""

    workers: Mapping[str, tuple[str, int]] | None = None


@dataclass(frozen=True)
class Poll:
    """The driver's turn: check the pool (``no_worker_timeout``) and (``fill``) fill the free slots."""

    fill: bool = True


@dataclass(frozen=True)
class Idle:
    """Nothing is in flight or handed over (the run fails if nothing is left to run or wait for)."""


@dataclass(frozen=True)
class CloseEpochs:
    """Record the epochs that are done (a resumed run, once it merged the uploads it found)."""


@dataclass(frozen=True)
class Joined:
    worker: str
    nthreads: int


@dataclass(frozen=True)
class Identified:
    """A worker that joined said what instance it runs on (asked at once: not only from its first shard)."""

    worker: str
    instance: str | None
    market: str | None


@dataclass(frozen=True)
class Left:
    worker: str


@dataclass(frozen=True)
class Preempt:
    """A notice that ``worker`` will be reclaimed in ``window`` seconds (None: now, or unknown).
    Replies ``(reissued keys, kept keys)``."""

    worker: str
    window: float | None = None


@dataclass(frozen=True)
class Settle:
    """The notice's margin is reached: move the ``kept`` copies still running on ``worker``.  Replies the new keys."""

    worker: str
    kept: tuple[str, ...]


@dataclass(frozen=True)
class Stop:
    """The user (or the cloud layer) stops the run; ``cancel``: it ends "cancelled", without a result."""

    reason: str
    cancel: bool = False


@dataclass(frozen=True)
class Reissue:
    """Train (epoch, shard) once more from the current version.  Replies the new copy's key (None: parked)."""

    epoch: int
    shard: int


@dataclass(frozen=True)
class Resumed:
    """What the store says of a run that is resumed (:func:`~vcdask.engine.recovery.read_back`)."""

    merged: dict[int, set[int]]
    ends: dict[int, tuple[int, str]]
    attempts: dict[tuple[int, int], int]
    pending: tuple[dict[str, Any], ...] = ()
    skipped: dict[int, set[int]] = field(default_factory=dict)  # shards given up in the epochs still open
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)  # epoch -> its row, as the last session saw it
    #: Where a target and patience count from: the epochs done for a run extended after it ended (None: the
    #: epochs in ``ends``); where its last session counted from for one whose scheduler died.
    resumed_at: int | None = None


@dataclass(frozen=True)
class StoreFault:
    """A task (or the final validation) could not reach the store."""

    task: TaskRecord
    error: BaseException


@dataclass(frozen=True)
class StoreBack:
    """A task got through to the store."""


@dataclass(frozen=True)
class Validated:
    """The final validation's numbers."""

    step: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class Finish:
    """The driver's loop is over: turn down what was handed over and cancel what is out."""


Event = (
    Started
    | HandOver
    | Completed
    | Result
    | TaskFailed
    | Lost
    | Merged
    | Committed
    | Tick
    | Poll
    | CloseEpochs
    | Idle
    | Joined
    | Identified
    | Left
    | Preempt
    | Settle
    | Stop
    | Reissue
    | Resumed
    | StoreFault
    | StoreBack
    | Validated
    | Finish
)


# -- effects: what the shell does --------------------------------------------------------------------
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
    """Read back the record of finished task ``key`` (then :class:`Result`, :class:`TaskFailed` or :class:`Lost`)."""

    key: str
    task: TaskRecord


@dataclass(frozen=True)
class Merge:
    """Merge (or turn down) a shard result in the merge thread (then :class:`Merged`)."""

    task: TaskRecord
    record: dict[str, Any]
    completes: bool
    max_staleness: int | None
    in_use_step: int
    ahead: str | None = None


@dataclass(frozen=True)
class Commit:
    """Commit the merges not in a version yet (then :class:`Committed`)."""


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
