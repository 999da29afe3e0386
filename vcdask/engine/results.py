"""Reading a finished task's record back: from the worker that holds it, or from the store.

A shard task writes its update, with its record, to the store before it returns, so a record
whose worker died or froze after finishing is not lost with that worker.  Dask would run such a
task again (its result is gone) and the run, reading results one at a time, would wait for that
rerun: the whole run held up by one worker.  Instead the run reads the record from the store
(:func:`read`) and cancels the Dask task; a record the store does not have either is a lost
copy, re-issued by the run like any other.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from ..updates import read_update_meta, update_path
from . import faults

if TYPE_CHECKING:
    from .inflight import TaskRecord
    from .run import Run

__all__ = ["PATIENCE", "fetch", "read"]

logger = logging.getLogger(__name__)

#: Seconds the run waits for a finished task's record from the worker holding it (a few
#: milliseconds when that worker answers) before it reads the record from the store instead.
PATIENCE = 5.0
#: Seconds between looks at the scheduler while the run waits for a record.
POLL = 0.25


async def read(run: Run, future: Any, task: TaskRecord) -> dict[str, Any] | None:
    """The record of the finished task ``future`` (``task`` is the run's record of it).

    Returns None when the record cannot be had (its worker is gone or does not answer, and the
    store has no copy of it): the copy is then recorded as lost and its shard re-issued, or the
    validation submitted again.  A task's own error is raised, for the failure policy.
    """
    got = await fetch(run, future)
    if not isinstance(got, str) and got.get("kind") != "abandoned":
        return got
    why = got if isinstance(got, str) else "the copy gave up: the run no longer waited for it"
    record = await run.lane.call(_stored_record, run, task) if task.kind == "update" else None
    if record is not None:
        logger.warning(
            "run %s: read the result of epoch %d shard %d attempt %d from the store (%s)",
            run.id,
            task.epoch,
            task.shard,
            task.attempt,
            why,
        )
        return record
    logger.warning("run %s: the result of %s task %s is lost (%s)", run.id, task.kind, future.key, why)
    if task.kind == "update":
        run.ledger.record_copy(task, "lost", f"lost: the result was not read back ({why})", worker=task.worker)
        if not run.ledger.is_merged(task.epoch, task.shard) and not run.tasks.copy_running(task.epoch, task.shard):
            await faults.retry_or_give_up(run, task.epoch, task.shard, why, count=False)
    else:
        run.submit_validation(task.version, task.step, retry=task.attempt + 1)
    return None


async def fetch(run: Run, future: Any) -> dict[str, Any] | str:
    """The result of the finished task ``future`` from the worker holding it; or, when that worker
    left or did not hand it over within :data:`PATIENCE`, why not (the task is then cancelled: no
    rerun of a finished task; its work is in the store, or the run runs it afresh).  A task's own
    error is raised."""
    task = asyncio.ensure_future(_await(future))
    since = time.monotonic()
    gone = False
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL)
            if done:
                return task.result()
            run.check_workers()  # a run waiting here still watches its pool (no_worker_timeout)
            # the key leaves "memory" when the only worker holding the result leaves: Dask would run it again
            gone = run.tasks.state(future.key) not in ("memory", "erred")
            if gone or time.monotonic() - since > PATIENCE:
                break
    finally:
        task.cancel()
    await run.tasks.client.cancel([future])
    return "its worker left" if gone else f"its worker did not hand it over in {PATIENCE:g} s"


def _stored_record(run: Run, task: TaskRecord) -> dict[str, Any] | None:
    """The record a shard task stored with its update (the run's merge thread), or None."""
    path = update_path(run.id, task.epoch, task.shard, task.attempt)
    try:
        meta = read_update_meta(run.store.files, path)
    except FileNotFoundError:
        return None
    except Exception:  # a store that does not answer now: the copy is re-issued instead
        logger.warning("run %s: reading %s back failed", run.id, path, exc_info=True)
        return None
    if not meta:
        return None
    # the run's own clock for what the worker's record would have said (it is written before the upload)
    seconds = time.monotonic() - (task.started or task.submitted)
    return {"seconds": seconds, "upload_seconds": math.nan, **meta}


async def _await(future: Any) -> Any:
    return await future
