"""Validation tasks: where they run, their deadline, and running a late one again elsewhere.

An epoch closes only once its end version is validated, so a validation that never comes back holds
the whole run.  A worker that freezes (SIGSTOP, a hung driver, a VM paused by its host) stays
connected to the scheduler until Dask's ``worker-ttl`` (minutes) runs out, with the validation
processing there; a run once waited that long at the end of an epoch.  Validations therefore get
what shard copies get: placement on usable workers away from stuck ones, a deadline derived from
their own measured times, and a fresh attempt elsewhere when one is late or waits in a stuck
worker's queue.  The first result for a version counts; a late one is ignored.

Functions of the :class:`~vcdask.engine.run.Run` (the event loop only).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..worker import validate_version
from . import faults, policy, results
from .events import final_validate_key
from .inflight import TaskRecord

if TYPE_CHECKING:
    from .run import Run

__all__ = ["deadline", "final", "overdue", "placement"]

logger = logging.getLogger(__name__)


def placement(run: Run, avoid: set[str] | frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """Dask placement for a validation task: any usable worker (not excluded, not draining), away from
    the stuck ones and ``avoid`` unless no other is usable; None when no worker is usable (the run
    parks the validation until one is)."""
    avoided = faults.stuck_workers(run) | set(avoid)
    return run.dispatch.placement(None, run.pool.usable(), len(run.pool.connected), avoided)


def deadline(run: Run, worker: str | None = None) -> float:
    """Seconds a validation may run: the shard copies' rule (:func:`~vcdask.engine.policy.deadline`)
    applied to the run's measured validation times (the shards' times until a validation has come
    back), one task per slot; the cold-worker floor on a worker that has finished no shard of the run
    yet.  A deadline too short costs a second validation, never a result: the late one is kept."""
    measured = run.ledger.validation_seconds or run.ledger.shard_seconds
    return policy.deadline(run.res, measured, 1, cold=run.pool.cold(worker))


def overdue(run: Run, now: float, stuck: set[str], patience: float) -> None:
    """Run every late validation again elsewhere: one past its deadline, one that never started within
    ``patience`` (the shard copies'), and one waiting to start on a ``stuck`` worker.  The late one is
    left alone (not cancelled): while it is processing on a frozen worker, the scheduler counts that
    worker's slot as taken and sends it nothing else."""
    for key, task in list(run.tasks.tasks.items()):
        if task.kind != "validation" or task.overdue or task.step in run.ledger.validations:
            continue
        running_on = run.tasks.processing_on(key)
        if task.started is None and running_on is not None and running_on in stuck:
            verdict: Any = policy.Overdue(f"queued on {running_on}, which is stuck", blame=False)
        else:
            verdict = policy.overdue(
                now=now,
                submitted=task.submitted,
                started=task.started,
                running_on=running_on,
                worker=task.worker,
                behind=0,
                stale_after=None,
                limit=deadline(run, task.worker),
                patience=patience,
            )
        if verdict == "restart":  # its worker died: Dask is moving it, it starts afresh
            task.started, task.submitted = None, now
            continue
        if verdict is None:
            continue
        task.overdue = True
        where = task.worker if task.started is not None else running_on
        logger.warning(
            "run %s: the validation of version %d %s; validating it again elsewhere", run.id, task.step, verdict.why
        )
        run.submit_validation(task.version, task.step, retry=task.attempt + 1, avoid={where} if where else set())


async def final(run: Run, version: str | None, step: int) -> None:
    """Validate the final version, waiting through store outages (within ``store_outage_timeout``), and
    validating it again elsewhere when an attempt is late (:func:`.validations.deadline`, twice over:
    the attempt may wait for a worker to start it)."""
    avoid: set[str] = set()
    for attempt in range(1000):
        future = run.tasks.client.submit(
            validate_version,
            run.store,
            run.id,
            version,
            step,
            key=final_validate_key(run.id, attempt),
            priority=10,
            **(placement(run, avoid) or {}),
        )
        limit = 2 * deadline(run)
        try:
            rec = await asyncio.wait_for(results.fetch(run, future), limit)
        except TimeoutError:
            on = run.tasks.processing_on(future.key)
            logger.warning(
                "run %s: the final validation did not come back from %s within %.1f s; validating it elsewhere",
                run.id,
                on or "the scheduler's queue",
                limit,
            )
            avoid |= {on} if on else set()
            continue
        except StoreError as exc:
            faults.store_fault(run, TaskRecord("validation", step=step, version=version, attempt=attempt), exc)
            run.dispatch.parked_validations.clear()
            await asyncio.sleep(run.outage.wait_seconds())
            continue
        if isinstance(rec, str):  # lost with its worker: run it again
            logger.warning("run %s: the final validation's result is lost (%s); running it again", run.id, rec)
            continue
        faults.store_back(run)
        run.ledger.validations[rec["step"]] = rec["metrics"]
        return
