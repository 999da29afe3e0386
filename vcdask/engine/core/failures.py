"""What a run does when something goes wrong: lost and failed tasks, rejected updates, store faults,
copies overdue, re-issues, shards given up, the run failing.

Functions of the :class:`~.state.RunState`; the decisions themselves are :mod:`~vcdask.engine.policy`'s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...errors import (
    DeviceUnavailableError,
    StoreAccessDeniedError,
    StoreError,
    StoreNotFoundError,
    StoreNotSharedError,
    StoreOutageError,
    WorkerEnvironmentError,
)
from .. import policy
from ..inflight import TaskRecord
from .dispatching import submit_shard, submit_validation
from .messages import Commit, Fail, Failure, FailureKind, Skip
from .state import RunState

if TYPE_CHECKING:
    from ..pool import Fault

__all__ = [
    "blame",
    "exclude_unfit",
    "fail",
    "give_up",
    "lost",
    "move_queued_off",
    "overdue",
    "retry_or_give_up",
    "store_back",
    "store_fault",
    "task_failed",
    "validate_head",
]

logger = logging.getLogger(__name__)


#: What a task raises when its worker cannot run the run at all (no device of the run's, no module of its model, no
#: view of its store): the worker is unfit (:func:`unfit`), not the shard.
UNFIT_ERRORS = (DeviceUnavailableError, WorkerEnvironmentError, StoreNotSharedError)

#: Copies of one shard lost to workers without the run's device (at least ``max_attempts``) that give it up while
#: no worker has trained a shard of the run: workers without it joining one after another.
UNFIT_LOSSES = 10


def fail(state: RunState, kind: FailureKind, message: str, error: BaseException | None = None) -> None:
    """The run fails: a :class:`~.messages.Fail` effect (the shell ends the run on it; no effect after it
    is carried out)."""
    if state.failure is None:
        state.failure = Failure(kind, message, error)
        state.out.append(Fail(state.failure))


def blame(state: RunState, worker: str, kind: Fault, why: str | None = None) -> None:
    """Count a fault against ``worker`` (``why``: what it was); exclude it once it has had too many."""
    excluded = state.pool.fault(worker, kind, why)
    if excluded is not None:
        last = f" (last: {why})" if why else ""
        logger.warning("run %s: excluding worker %s: %s%s", state.id, worker, excluded, last)
        state.emit("excluded", worker=worker, reason=excluded, worker_row=state.pool.record(worker).as_row())


def task_failed(state: RunState, task: TaskRecord, exc: BaseException) -> None:
    """A task raised: a store fault, a lost worker (Dask gave up re-running it), or a real error (which fails
    the run, unless a shard task raised it and ``on_shard_failure="skip"``: then it is one of its attempts)."""
    from distributed.scheduler import KilledWorker

    unfit_worker = task.worker or getattr(exc, "process", None)  # (the task may fail before it said it started)
    if isinstance(exc, UNFIT_ERRORS) and unfit_worker is not None:
        unfit(state, task, unfit_worker, exc)
        return
    if isinstance(exc, StoreError) and not isinstance(exc, (StoreNotFoundError, StoreAccessDeniedError)):
        store_fault(state, task, exc)
        return
    if task.kind == "update" and isinstance(exc, StoreAccessDeniedError) and task.worker is not None:
        denied(state, task, task.worker, exc)
        return
    was_lost = isinstance(exc, (KilledWorker, OSError))
    # an OSError of the worker's environment (a path it cannot read, a disk it cannot write): its copy goes elsewhere
    avoid = task.worker if was_lost and task.began and not isinstance(exc, KilledWorker) else None
    if task.kind == "update" and was_lost:
        # Dask already retried it on other workers (allowed-failures); each loss is a worker failure,
        # but only a task that was running counts against its worker: queued ones were collateral
        for address in _suspects(exc) if task.began else ():
            blame(state, address, "failed")
            state.pool.wasted(address, state.clock() - (task.started or state.clock()))
            state.emit(
                "lost",
                epoch=task.epoch,
                shard=task.shard,
                worker=address,
                worker_row=state.pool.record(address).as_row(),
                why=f"{type(exc).__name__}",
            )
        # (the history's worker: where the copy started, else the one Dask names, as the workers' counts do)
        where = task.worker if task.began else next(iter(_suspects(exc)), task.worker)
        state.ledger.record_copy(task, "lost", f"lost: {type(exc).__name__}: {exc}", worker=where)
        if not state.ledger.is_merged(task.epoch, task.shard):
            # A task that never started was only queued on the dead worker: not its fault.
            retry_or_give_up(state, task.epoch, task.shard, _lost_why(exc), avoid=avoid, count=task.began)
        return
    # an epoch may be waiting for these numbers; a validation dies mostly as collateral of a shard
    # that killed its worker, so it gets more attempts than a shard does
    if task.kind == "validation" and was_lost and task.attempt + 1 < max(10, state.res.max_attempts):
        submit_validation(state, task.version, task.step, retry=task.attempt + 1, avoid={avoid} if avoid else None)
        return
    if task.kind == "update" and state.res.on_shard_failure == "skip":
        # the step, the loss or the Dataset raised on this shard (a corrupt sample, a worker's out-of-memory):
        # an attempt of the shard, tried again elsewhere, given up after max_attempts; no worker is blamed
        logger.warning("run %s: shard %d of epoch %d raised %r", state.id, task.shard, task.epoch, exc)
        state.ledger.record_copy(task, "failed", f"failed: {exc!r}", worker=task.worker)
        if not state.ledger.done(task.epoch, task.shard):
            retry_or_give_up(state, task.epoch, task.shard, repr(exc), avoid=task.worker)
        return
    fail(state, "task", f"{task.kind} task (epoch {task.epoch}, shard {task.shard}) failed: {exc!r}", exc)


def unfit(state: RunState, task: TaskRecord, worker: str, exc: BaseException) -> None:
    """``worker`` has no device of the run's (``device="cuda"`` on a CPU machine of a mixed fleet), cannot import
    the module of the run's model (:class:`~vcdask.errors.WorkerEnvironmentError`) or does not see its store
    (:class:`~vcdask.errors.StoreNotSharedError`, another machine's directory at the same path): it gets no
    more shards (excluded at once: every task there would fail alike), and the task goes elsewhere, its attempt
    not counted against the shard's ``max_attempts`` (a fleet of such workers leaves none usable: the run waits
    for a worker that has the device, ``no_worker_timeout``, then fails naming why each was excluded; while no
    worker has trained a shard of the run, :data:`UNFIT_LOSSES` such losses of one shard give it up)."""
    why = f"{exc}"
    exclude_unfit(state, worker, why)
    if task.kind != "update":
        submit_validation(state, task.version, task.step, retry=task.attempt + 1, avoid={worker})
        return
    state.ledger.record_copy(task, "lost", f"lost: {why}", worker=worker)
    key = (task.epoch, task.shard)
    if not state.ledger.is_merged(*key) and not state.tasks.copy_running(*key):
        # not an attempt of the shard; but while no worker has trained a shard of the run (has the device), such
        # losses have a bound of their own: workers without it joining one after another kept it going round
        losses = state.dispatch.unfit[key] = state.dispatch.unfit.get(key, 0) + 1
        if losses >= max(UNFIT_LOSSES, state.res.max_attempts) and not any(r.done for r in state.pool.records.values()):
            lacking = "without the run's device" if isinstance(exc, DeviceUnavailableError) else "that cannot run it"
            give_up(state, *key, f"shard {task.shard} of epoch {task.epoch} went to {losses} workers {lacking}, "
                    f"and no worker has trained a shard of the run (last: {why})")  # fmt: skip
            return
        retry_or_give_up(state, *key, why, avoid=worker, count=False)


def exclude_unfit(state: RunState, worker: str, why: str) -> None:
    """``worker`` cannot run the run's tasks (``why``): it gets no more shards, named in a warning and an
    ``excluded`` event the first time."""
    if state.pool.unfit(worker, why):
        logger.warning("run %s: worker %s gets no shards: %s", state.id, worker, why)
        state.emit("excluded", worker=worker, reason=why, worker_row=state.pool.record(worker).as_row())


def denied(state: RunState, task: TaskRecord, worker: str, exc: BaseException) -> None:
    """A shard task's worker (``worker``) was refused by the store: no credentials of its own (a worker that
    joined after the run's start was checked, without the environment the others have).  The worker's fault,
    not the shard's: it is blamed (excluded after ``max_worker_failures``, the run going on without it) and the
    copy tried elsewhere.  The attempt counts, so a store that refuses every worker (credentials that expired)
    still gives the shard up after ``max_attempts``, saying why."""
    why = _lost_why(exc)
    blame(state, worker, "failed", f"the store refused it: {why}")
    state.ledger.record_copy(task, "lost", f"lost: {why}", worker=worker)
    if not state.ledger.is_merged(task.epoch, task.shard):
        retry_or_give_up(state, task.epoch, task.shard, why, avoid=worker)


def lost(state: RunState, task: TaskRecord, why: str) -> None:
    """A finished task's record could not be read back: re-issue its shard, or validate again."""
    if task.kind != "update":
        submit_validation(state, task.version, task.step, retry=task.attempt + 1)
        return
    state.ledger.record_copy(task, "lost", f"lost: the result was not read back ({why})", worker=task.worker)
    if not state.ledger.is_merged(task.epoch, task.shard) and not state.tasks.copy_running(task.epoch, task.shard):
        retry_or_give_up(state, task.epoch, task.shard, why, count=False)


def store_fault(state: RunState, task: TaskRecord, exc: BaseException) -> None:
    """A task failed because the store (parameters or data) did not answer: not the worker's fault,
    not the shard's.  Its work goes back to wait; dispatch holds off with backoff, and the run
    fails only once the store has been out longer than ``store_outage_timeout``."""
    try:
        starts = state.outage.fault(exc)
    except StoreOutageError as out:
        fail(state, "store", str(out), None)
        return
    if starts:
        state.emit("paused", cause="store", why=str(exc))
        logger.warning("run %s paused: a task could not reach the store: %s", state.id, exc)
    if task.kind == "update":
        state.ledger.record_copy(task, "store fault", f"store fault: {exc}", worker=task.worker)
        if not state.ledger.is_merged(task.epoch, task.shard) and not state.tasks.copy_running(task.epoch, task.shard):
            state.dispatch.returned.append((task.epoch, task.shard))
    else:
        state.dispatch.parked_validations.append((task.version, task.step, task.attempt + 1))


def store_back(state: RunState) -> None:
    """A task got through to the store: the outage (if any) is over."""
    lasted = state.outage.back()
    if lasted is not None:
        logger.warning("run %s: the store answers again after %.0f s; continuing", state.id, lasted)
        state.emit("resumed", cause="store", after=lasted)


def retry_or_give_up(
    state: RunState, epoch: int, shard: int, why: str, avoid: str | None = None, count: bool = True
) -> None:
    """Re-issue (epoch, shard) unless it has used up its attempts; then apply ``on_shard_failure``."""
    failures = state.dispatch.failed(epoch, shard, count)
    if state.tasks.copy_running(epoch, shard):
        return  # another copy is still running
    if policy.after_failure(failures, state.res) == "retry":
        submit_shard(state, epoch, shard, avoid=avoid)
        return
    give_up(state, epoch, shard, f"shard {shard} of epoch {epoch} failed {failures} times (last: {why})")


def give_up(state: RunState, epoch: int, shard: int, message: str) -> None:
    """(epoch, shard) gets no more copies: apply ``on_shard_failure`` (stop the run, or skip it)."""
    if state.res.on_shard_failure == "stop":
        fail(state, "shard", message + "; on_shard_failure='stop'")
        return
    logger.warning("run %s: %s; skipping it for this epoch (on_shard_failure='skip')", state.id, message)
    ledger = state.ledger
    ledger.record(epoch, shard, state.dispatch.last_attempt(epoch, shard), "skipped", reason=f"skipped: {message}")
    ended = ledger.skip(epoch, shard, state.head.step, why=message)
    if ended and not ledger.merged.get(epoch):  # nothing of the epoch trained: the data, step or loss fail on all
        fail(state, "shard", f"every shard of epoch {epoch} was given up, none merged (the last: {message})")
        return
    # (in the run's progress too, before any commit this skip leads to: a resume trains it no more, and
    # retention keeps the version that ends its epoch, whose own ``epoch`` may be the next one's)
    state.out.append(Skip(epoch, shard, state.head.step if ended else None))
    if not ended:
        return
    if state.spec.validation is None or state.head.step in ledger.validations:  # (the epoch ends at head.step)
        close_epochs(state)
        return
    validate_head(state)  # the epoch's end version must exist to be validated


def validate_head(state: RunState) -> None:
    """Validate the server's newest version: now if it is committed, else once it is (a :class:`~.messages.Commit`)."""
    if state.head.committed:
        submit_validation(state)
        return
    if not state.validate_committed:
        state.validate_committed = True
        state.out.append(Commit())


def close_epochs(state: RunState) -> None:
    """Record the epochs that are done; a target reached or patience run out stops the run."""
    stop = state.ledger.close_epochs()
    if stop is not None:
        state.stopping = stop


def overdue(state: RunState, task: TaskRecord, verdict: policy.Overdue, worker: str | None) -> None:
    """Re-issue ``task`` elsewhere; a worker whose running task is late also loses its queue.

    A verdict without blame (the task fell too far behind the run, however fast its worker)
    charges neither the worker nor the shard."""
    task.overdue = True
    logger.warning(
        "run %s: shard %d of epoch %d %s%s; re-issuing",
        state.id,
        task.shard,
        task.epoch,
        verdict.why,
        f" on {worker}" if worker else "",
    )
    state.emit("reissue", epoch=task.epoch, shard=task.shard, worker=worker, why=verdict.why)
    if not verdict.blame:
        retry_or_give_up(state, task.epoch, task.shard, verdict.why, avoid=worker, count=False)
        return
    began = task.began  # (not one only the hand-over counted started: it may wait behind other work)
    if worker is not None and began:
        blame(state, worker, "timed_out")
        state.emit("worker", worker_row=state.pool.record(worker).as_row())
        move_queued_off(state, {worker})  # stuck behind it: move, no blame
    # a copy that never started (queued while workers died and restarted) is not the shard's failure
    retry_or_give_up(state, task.epoch, task.shard, verdict.why, avoid=worker, count=began)


def move_queued_off(state: RunState, stuck: set[str]) -> None:
    """Re-issue elsewhere, without blame, the copies waiting to start on a ``stuck`` worker.

    A copy is sticky to its shard's last worker; one that worker had queued before it got stuck would
    otherwise wait there, holding a slot, until the worker resumes (if ever): with one task in flight
    per worker, a frozen worker once stalled a run this way."""
    if not stuck:
        return
    for key, other in list(state.tasks.updates()):
        if not other.overdue and not other.began and state.tasks.processing_on(key) in stuck:
            other.overdue = True
            submit_shard(state, other.epoch, other.shard, avoid=stuck)


def _lost_why(exc: BaseException) -> str:
    """What a lost copy says when its shard is given up: Dask's error by its name (its text is about Dask's
    retries), any other (an ``OSError`` of the worker's environment: a path it cannot read, a disk it cannot
    write) with its text, which is all the user hears of it."""
    from distributed.scheduler import KilledWorker

    if isinstance(exc, KilledWorker):
        return "KilledWorker: its worker died running it"
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."


def _suspects(exc: BaseException) -> list[str]:
    """Worker addresses a KilledWorker names (the last one that died running the task)."""
    worker = getattr(exc, "last_worker", None)
    address = getattr(worker, "address", worker)
    return [address] if isinstance(address, str) else []
