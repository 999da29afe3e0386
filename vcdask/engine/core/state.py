"""A run's state, as its core sees it: the engine's parts, the task table, counters and a phase.

Nothing here does I/O or awaits.  The server's side of the merge boundary is known only as its last
:class:`~vcdask.engine.committing.Head` (the shell refreshes it from the merge thread before each event,
and the events that follow a merge or a commit carry it); Dask's side only as the task table
(:class:`~vcdask.engine.inflight.TaskTable`), which reads where each task is processing.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..committing import Head
from ..dispatch import Dispatcher
from ..events import EventKind
from ..inflight import TaskTable
from ..ledger import Ledger
from ..outage import StoreOutage
from ..policy import staleness_limit
from ..pool import WorkerPool
from .messages import Effect, Emit, Failure

if TYPE_CHECKING:
    from ...spec import RunSpec

__all__ = ["Phase", "RunState"]


class Phase(enum.Enum):
    """Where a run is: its ``status``."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    ERROR = "error"


class _Emitter:
    """What the ledger publishes goes out as :class:`~.messages.Emit` effects."""

    def __init__(self, state: RunState):
        self.state = state

    def emit(self, kind: EventKind, **fields: Any) -> None:
        self.state.emit(kind, **fields)


class RunState:
    """Everything a run's core decides on.

    Parameters
    ----------
    spec : RunSpec
    workers : mapping of str to int
        The workers connected when the run starts: address -> threads.
    scheduler : distributed.Scheduler
        Its task table only (see :class:`~vcdask.engine.inflight.TaskTable`).
    tasks : TaskTable, optional
        The task table (the shell passes its :class:`~vcdask.engine.inflight.InFlight`).
    clock : callable
        Monotonic seconds (deadlines, backoffs).
    wall : callable
        Wall-clock seconds (the run's own clock, in its history, counts from its start).
    """

    def __init__(
        self,
        spec: RunSpec,
        workers: dict[str, int],
        scheduler: Any = None,
        *,
        tasks: TaskTable | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.spec, self.res, self.id = spec, spec.resilience, spec.run_id
        self.clock, self.wall = clock, wall
        self.started = wall()
        self.phase = Phase.STARTING
        self.out: list[Effect] = []  # the effects of the event being handled
        self.pool = WorkerPool(self.res, spec.tasks_per_slot, workers, clock=self.now)
        self.dispatch = Dispatcher(spec.shards.n_shards, spec.max_epochs, spec.seed)
        self.ledger = Ledger(
            spec.shards.n_shards,
            spec.max_epochs,
            validated=spec.validation is not None,
            target=spec.target,
            events=_Emitter(self),  # type: ignore[arg-type]
            clock=self.now,
            patience=spec.patience,
            monitor=spec.monitor,
        )
        self.tasks = tasks if tasks is not None else TaskTable(scheduler)
        self.outage = StoreOutage(self.res.store_outage_timeout, clock=clock)
        self.head = Head()
        #: shard results taken from the workers, and how many of them the merge path has finished with
        #: (merged and committed, or turned down): a task that asks for its base waits for the ones before it
        self.arrived = 0
        self.settled = 0
        self.handed_over = 0  # records taken as their tasks finished (not through Dask)
        self.stopping: str | None = None
        self.cancelled = False  # stopped by RunHandle.cancel(): it ends "cancelled", without a result
        self.asked_to_stop = False  # stopped from outside (stop(), Ctrl-C, a time limit), not by its own end
        self.failure: Failure | None = None
        self.idle_since: float | None = None  # since when no usable worker is connected
        self.no_workers: str | None = None  # why the run waits for workers (status()["paused"])
        self.taking = True  # False once the driver's loop is over: hand-overs are left to Dask then
        #: the branch's head when the run was started (its initial version, or where a resumed run goes on):
        #: what ``status`` shows until the run's server has loaded it
        self.head_at_start: str | None = None
        self.error: str | None = None  # why the run failed (the failure, or a traceback)
        self.ended: float | None = None  # wall time when the driver returned
        self.final: dict[str, Any] | None = None  # the result dict, kept once the run has ended
        self.validate_committed = False  # a validation of the head is due once it is committed
        self.settle_on_commit = 0  # results merged whose commit (their epoch's end) settles them

    # -- clocks -----------------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the run started (its history's time)."""
        return self.wall() - self.started

    # -- what the handlers share --------------------------------------------------------------------
    def emit(self, kind: EventKind, **fields: Any) -> None:
        self.out.append(Emit(kind, fields))

    def staleness_limit(self) -> int | None:
        return staleness_limit(self.res.max_staleness, self.spec.shards.n_shards, self.pool.slots())

    def finished(self) -> bool:
        return self.stopping is not None or self.ledger.finished()

    def in_use_step(self) -> int:
        """The oldest version step the run's tasks may still read: the bases of the shard copies in flight
        and of the results handed over but not merged yet, the versions its validations measure, and the
        newest version (which the next copy gets).

        Given to the merge thread with each merge and collection, whose retention keeps every version
        from there on.  A value read a while ago is only lower than the truth: versions handed out later
        are the newest committed one at the time, never older.
        """
        steps = [task.step for task in self.tasks.records.values()]
        steps += [task.step for task, _ in self.tasks.handed]  # taken, not merged yet (``step``: its base)
        steps += [step for _, step, _ in self.dispatch.parked_validations]
        return min([*steps, self.head.version_step])

    def busy_workers(self) -> set[str]:
        """Workers that hold their share of shard copies (``WorkerPool.share``), running or queued
        there: a copy sent to one would wait while another worker is free."""
        return {a for a, n in self.tasks.held().items() if n >= self.pool.share(a)}

    def stuck_workers(self) -> set[str]:
        """Workers still running a copy that was re-issued (late, or fell too far behind), or holding a
        validation that was run again elsewhere: frozen or far too slow for now.  New copies and
        validations avoid them, and copies queued there move."""
        stuck = set()
        for key, t in list(self.tasks.records.items()):
            on = self.tasks.processing_on(key) if t.overdue else None
            # a shard copy only where it started (one queued there was moved off, not stuck)
            if on is not None and (t.kind == "validation" or (t.began and t.worker == on)):
                stuck.add(on)
        return stuck
