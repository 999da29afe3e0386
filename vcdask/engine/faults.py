"""What a run does when something goes wrong: lost and failed tasks, rejected updates, store faults,
re-issues, the user stopping it (preemption notices: :mod:`.notice`).

Functions of the :class:`~vcdask.engine.run.Run` (the event loop only); the decisions themselves
are :mod:`~vcdask.engine.policy`'s.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..errors import StoreAccessDeniedError, StoreError, StoreNotFoundError
from ..updates import delete_run_updates, delete_update
from . import policy
from .inflight import TaskRecord

if TYPE_CHECKING:
    from .pool import Fault
    from .run import Run

__all__ = [
    "blame",
    "give_up",
    "overdue",
    "cancel_other_copies",
    "rejected",
    "reissue",
    "retry_or_give_up",
    "stop",
    "store_back",
    "store_fault",
    "task_failed",
]

logger = logging.getLogger(__name__)


def drop_update(store: Any, path: str) -> None:
    delete_update(store.files, path)


def drop_run_updates(store: Any, run_id: str) -> None:
    delete_run_updates(store.files, run_id)


def blame(run: Run, worker: str, kind: Fault) -> None:
    """Count a fault against ``worker``; exclude it once it has had too many."""
    excluded = run.pool.fault(worker, kind)
    if excluded is not None:
        logger.warning("run %s: excluding worker %s: %s", run.id, worker, excluded)
        run.events.emit("excluded", worker=worker, reason=excluded, worker_row=run.pool.record(worker).as_row())


async def task_failed(run: Run, task: TaskRecord, exc: BaseException) -> None:
    """A task raised: a store fault, a lost worker (Dask gave up re-running it), or a real error."""
    from distributed.scheduler import KilledWorker

    if isinstance(exc, StoreError) and not isinstance(exc, (StoreNotFoundError, StoreAccessDeniedError)):
        store_fault(run, task, exc)
        return
    lost = isinstance(exc, (KilledWorker, OSError))
    if task.kind == "update" and lost:
        # Dask already retried it on other workers (allowed-failures); each loss is a worker failure,
        # but only a task that was running counts against its worker: queued ones were collateral
        for address in _suspects(exc) if task.started is not None else ():
            blame(run, address, "failed")
            run.pool.wasted(address, time.monotonic() - (task.started or time.monotonic()))
            run.events.emit(
                "lost",
                epoch=task.epoch,
                shard=task.shard,
                worker=address,
                worker_row=run.pool.record(address).as_row(),
                why=f"{type(exc).__name__}",
            )
        run.ledger.record_copy(task, "lost", f"lost: {type(exc).__name__}: {exc}")
        if not run.ledger.is_merged(task.epoch, task.shard):
            # A task that never started was only queued on the dead worker: not its fault.
            await retry_or_give_up(run, task.epoch, task.shard, f"{type(exc).__name__}", count=task.started is not None)
        return
    # an epoch may be waiting for these numbers; a validation dies mostly as collateral of a shard
    # that killed its worker, so it gets more attempts than a shard does
    if task.kind == "validation" and lost and task.attempt + 1 < max(10, run.res.max_attempts):
        run.submit_validation(task.version, task.step, retry=task.attempt + 1)
        return
    raise RuntimeError(f"{task.kind} task (epoch {task.epoch}, shard {task.shard}) failed: {exc!r}") from exc


def store_fault(run: Run, task: TaskRecord, exc: BaseException) -> None:
    """A task failed because the store (parameters or data) did not answer: not the worker's fault,
    not the shard's.  Its work goes back to wait; dispatch holds off with backoff, and the run
    fails only once the store has been out longer than ``store_outage_timeout``."""
    if run.outage.fault(exc):
        run.events.emit("paused", cause="store", why=str(exc))
        logger.warning("run %s paused: a task could not reach the store: %s", run.id, exc)
    if task.kind == "update":
        run.ledger.record_copy(task, "store fault", f"store fault: {exc}", worker=task.worker)
        if not run.ledger.is_merged(task.epoch, task.shard) and not run.tasks.copy_running(task.epoch, task.shard):
            run.dispatch.returned.append((task.epoch, task.shard))
    else:
        run.dispatch.parked_validations.append((task.version, task.step, task.attempt + 1))


def store_back(run: Run) -> None:
    """A task got through to the store: the outage (if any) is over."""
    lasted = run.outage.back()
    if lasted is not None:
        logger.warning("run %s: the store answers again after %.0f s; continuing", run.id, lasted)
        run.events.emit("resumed", cause="store", after=lasted)


async def rejected(run: Run, epoch: int, shard: int, worker: str, reason: str, fault: str | None) -> None:
    """The update of (epoch, shard) from ``worker`` failed its checks.

    A shard whose updates came back non-finite from two workers is the data's doing (or the loss's on
    it, or a learning rate the training diverges at), not theirs: the workers are not blamed (the
    first is forgiven), and the shard is given up at once, naming its samples."""
    run.ledger.set_shard(epoch, shard, "rejected")
    logger.warning(
        "run %s: rejected the update of shard %d, epoch %d from %s: %s", run.id, shard, epoch, worker, reason
    )
    if fault == "non-finite":
        seen = run.dispatch.non_finite.setdefault(shard, set())
        seen.add(worker)
        if len(seen) >= 2:
            for other in seen - {worker}:
                run.pool.forgive(other, "rejected")
            start, stop = run.spec.shards.bounds(shard)
            why = (
                f"its updates were non-finite (NaN/inf) on {len(seen)} workers ({', '.join(sorted(seen))}): "
                f"the data of samples {start}-{stop - 1} (training rows, after any hold-out), the loss on "
                "them, or a learning rate the training diverges at"
            )
            if not run.tasks.copy_running(epoch, shard):  # (a copy still out comes back NaN too, or merges)
                await give_up(run, epoch, shard, f"shard {shard} of epoch {epoch} is given up: {why}")
            return
    if fault not in ("stale", "unreadable"):  # not the worker's fault: its base was old / the store
        blame(run, worker, "rejected")
    # an update that came back too stale is the pace's doing, not the shard's: re-issue, uncounted
    await retry_or_give_up(run, epoch, shard, reason, avoid=worker, count=fault != "stale")


async def retry_or_give_up(
    run: Run, epoch: int, shard: int, why: str, avoid: str | None = None, count: bool = True
) -> None:
    """Re-issue (epoch, shard) unless it has used up its attempts; then apply ``on_shard_failure``."""
    failures = run.dispatch.failed(epoch, shard, count)
    if run.tasks.copy_running(epoch, shard):
        return  # another copy is still running
    if policy.after_failure(failures, run.res) == "retry":
        run.submit_shard(epoch, shard, avoid=avoid)
        return
    await give_up(run, epoch, shard, f"shard {shard} of epoch {epoch} failed {failures} times (last: {why})")


async def give_up(run: Run, epoch: int, shard: int, message: str) -> None:
    """(epoch, shard) gets no more copies: apply ``on_shard_failure`` (stop the run, or skip it)."""
    if run.res.on_shard_failure == "stop":
        raise RuntimeError(message + "; on_shard_failure='stop'")
    logger.warning("run %s: %s; skipping it for this epoch (on_shard_failure='skip')", run.id, message)
    run.ledger.record(epoch, shard, run.dispatch.last_attempt(epoch, shard), "skipped", reason=f"skipped: {message}")
    if not run.ledger.skip(epoch, shard, run.server.step):
        return
    if run.spec.validation is None or run.server.version_step in run.ledger.validations:
        run.close_epochs()
        return
    if not run.server.committed:  # the epoch's end version must exist to be validated
        await run.lane.commit()
    run.submit_validation()


async def cancel_other_copies(run: Run, epoch: int, shard: int) -> None:
    """The first valid result won: cancel the copies of (epoch, shard) that have not started.

    A copy already running is left to finish (cancelling cannot stop a running task); if its
    result arrives it is discarded and recorded as late."""
    await run.tasks.cancel([k for k, t in run.tasks.updates() if t.copy_of(epoch, shard) and t.started is None])


async def overdue(run: Run, task: TaskRecord, verdict: policy.Overdue, worker: str | None) -> None:
    """Re-issue ``task`` elsewhere; a worker whose running task is late also loses its queue.

    A verdict without blame (the task fell too far behind the run, however fast its worker)
    charges neither the worker nor the shard."""
    task.overdue = True
    logger.warning(
        "run %s: shard %d of epoch %d %s on %s; re-issuing", run.id, task.shard, task.epoch, verdict.why, worker
    )
    run.events.emit("reissue", epoch=task.epoch, shard=task.shard, worker=worker, why=verdict.why)
    if not verdict.blame:
        await retry_or_give_up(run, task.epoch, task.shard, verdict.why, avoid=worker, count=False)
        return
    if worker is not None and task.started is not None:
        blame(run, worker, "timed_out")
        run.events.emit("worker", worker_row=run.pool.record(worker).as_row())
        move_queued_off(run, {worker})  # stuck behind it: move, no blame
    # a copy that never started (queued while workers died and restarted) is not the shard's failure
    await retry_or_give_up(run, task.epoch, task.shard, verdict.why, avoid=worker, count=task.started is not None)


def stuck_workers(run: Run) -> set[str]:
    """Workers still running a copy that was re-issued (late, or fell too far behind), or holding a
    validation that was run again elsewhere (:mod:`.validations`): frozen or far too slow for now.  New
    copies and validations avoid them (:meth:`Run.submit_shard`), and copies queued there move."""
    stuck = set()
    for key, t in list(run.tasks.tasks.items()):
        on = run.tasks.processing_on(key) if t.overdue else None
        # a shard copy only where it started (one queued there was moved off, not stuck)
        if on is not None and (t.kind == "validation" or (t.started is not None and t.worker == on)):
            stuck.add(on)
    return stuck


def move_queued_off(run: Run, stuck: set[str]) -> None:
    """Re-issue elsewhere, without blame, the copies waiting to start on a ``stuck`` worker.

    A copy is sticky to its shard's last worker; one that worker had queued before it got stuck would
    otherwise wait there, holding a slot, until the worker resumes (if ever): with one task in flight
    per worker, a frozen worker once stalled a run this way."""
    if not stuck:
        return
    for key, other in list(run.tasks.updates()):
        if not other.overdue and other.started is None and run.tasks.processing_on(key) in stuck:
            other.overdue = True
            run.submit_shard(other.epoch, other.shard, avoid=stuck)


# -- what users and the cloud layer ask of a run --------------------------------------------------
async def stop(run: Run, reason: str, cancel: bool = False) -> None:
    """Stop dispatching and cancel the shards in flight; the driver then commits and finishes (with
    ``cancel``: as "cancelled", a run without a result)."""
    if not run.done.is_set() and run.stopping is None:
        run.stopping = reason
        run.cancelled = cancel
        await run.tasks.cancel([k for k, _ in run.tasks.updates()])


def reissue(run: Run, epoch: int, shard: int) -> str | None:
    """Train (epoch, shard) once more from the current version; the first valid result wins.  The new
    copy's key, or None when no worker is usable now (the copy is sent once one is)."""
    if run.tasks.completed is None or run.done.is_set():
        raise RuntimeError(f"run {run.id} is not running")
    return run.submit_shard(epoch, shard)


def _suspects(exc: BaseException) -> list[str]:
    """Worker addresses a KilledWorker names (the last one that died running the task)."""
    worker = getattr(exc, "last_worker", None)
    address = getattr(worker, "address", worker)
    return [address] if isinstance(address, str) else []
