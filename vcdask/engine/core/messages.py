"""What goes into a run's core and what comes out: events in, effects out.

The core (:func:`~vcdask.engine.core.handle`) takes one event at a time and returns the effects the
run's shell (:mod:`vcdask.engine.run`) carries out, in order.  Every value here is small and plain:
keys, task records, a shard result's record (the update itself stays in the store), a server
:class:`~vcdask.engine.committing.Head`.  An effect whose outcome the core needs (a merge, a commit, a
result read back) comes back to it as another event.  The effects, and a run's :class:`Failure`, are
defined in :mod:`.effects`; they are named here too, so that the core and the shell say ``m.Submit``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..committing import Head
from ..inflight import TaskRecord
from .effects import (
    Cancel,
    Commit,
    DropUpdate,
    Effect,
    Emit,
    Fail,
    Failure,
    FailureKind,
    Merge,
    Read,
    Reply,
    RunFailed,
    Skip,
    Submit,
)

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
