"""Watching the pool and the copies in flight: whether a usable worker is there, when each copy starts,
and when one is overdue (which version a copy starts from: :mod:`.handshake`).

Functions of the :class:`~vcdask.engine.run.Run` (the event loop only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ..errors import NoWorkersError
from . import faults, policy, validations

if TYPE_CHECKING:
    from .run import Run

__all__ = ["INTERVAL", "check_workers", "deadlines", "idle", "in_use_step", "task_started"]

INTERVAL = 0.2  # seconds between deadline checks

logger = logging.getLogger(__name__)


def task_started(run: Run, key: str, worker: str) -> None:
    """A task began to run on ``worker``: its deadline counts from now."""
    task = run.tasks.tasks.get(key)
    if task is None:
        return
    task.started, task.worker = time.monotonic(), worker
    if task.kind == "update":
        run.ledger.set_shard(task.epoch, task.shard, "running" if task.attempt == 0 else "re-issued")


def in_use_step(run: Run) -> int:
    """The oldest version step the run's tasks may still read: the bases of the shard copies in flight
    and of the results handed over but not merged yet, the versions its validations measure, and the
    newest version (which the next copy gets).

    Given to the merge thread with each merge and collection (:class:`~.lane.MergeLane`), whose
    retention keeps every version from there on.  A value read a while ago is only lower than the
    truth: versions handed out later are the newest committed one at the time, never older.
    """
    steps = [task.step for task in run.tasks.tasks.values()]
    steps += [task.step for task, _ in run.tasks.handed]  # taken, not merged yet (``step``: its base)
    steps += [step for _, step, _ in run.dispatch.parked_validations]
    return min([*steps, run.server.head.version_step])


async def deadlines(run: Run) -> None:
    """Re-issue shard copies that run past their deadline or fall too far behind, and the ones queued
    behind a late copy; validate again elsewhere the versions whose validation is late."""
    while True:
        await asyncio.sleep(INTERVAL)
        if run.stopping:
            continue
        ledger, tasks = run.ledger, run.tasks
        tps = run.spec.tasks_per_slot
        warm = policy.deadline(run.res, ledger.shard_seconds, tps)
        # copies of merged shards that no worker is running (e.g. theirs died); not a finished one: its
        # result is on its way back to the run, to be recorded for what it is (late), not as cancelled
        redundant = [
            k
            for k, t in tasks.updates()
            if ledger.is_merged(t.epoch, t.shard)
            and tasks.processing_on(k) is None
            and tasks.state(k) not in ("memory", "erred")
        ]
        if redundant:
            await tasks.cancel(redundant)
        if not run.pool.usable():
            continue  # nowhere to re-issue to: copies wait at the scheduler for workers to join
        stale_after = run.staleness_limit()
        now = time.monotonic()
        for key, task in tasks.updates():
            if task.overdue or ledger.is_merged(task.epoch, task.shard) or key not in tasks.tasks:
                continue
            limit = (
                policy.deadline(run.res, ledger.shard_seconds, tps, cold=True) if run.pool.cold(task.worker) else warm
            )
            running_on = tasks.processing_on(key)
            verdict = policy.overdue(
                now=now,
                submitted=task.submitted,
                started=task.started,
                running_on=running_on,
                worker=task.worker,
                # a copy that has not asked for its base yet will train from the newest version
                behind=run.server.step - task.step if task.based else 0,
                stale_after=stale_after,
                limit=limit,
                patience=warm * (tps + 2),
                draining=task.worker in run.pool.draining,
            )
            if verdict == "restart":  # its worker died: Dask is moving it, it starts afresh
                task.started, task.submitted, task.based = None, now, False
            elif verdict is not None:
                where = task.worker if verdict.blame and task.started is not None else running_on
                await faults.overdue(run, task, verdict, where)
        stuck = faults.stuck_workers(run)
        faults.move_queued_off(run, stuck)  # queued behind a late copy
        validations.overdue(run, now, stuck, patience=warm * (tps + 2))


def check_workers(run: Run) -> None:
    """Track whether a usable worker is connected.  Without one the run waits (tasks already
    submitted stay queued at the scheduler) and fails once it has waited ``no_worker_timeout``."""
    now = time.monotonic()
    if run.pool.usable():
        if run.idle_since is not None:
            logger.warning("run %s: usable workers again after %.0f s", run.id, now - run.idle_since)
            run.events.emit("resumed", cause="workers", after=now - run.idle_since)
            for task in run.tasks.tasks.values():  # copies queued meanwhile start their clocks now
                if task.started is None:
                    task.submitted = now
        run.idle_since, run.no_workers = None, None
        return
    states = run.pool.unusable()
    timeout = run.res.no_worker_timeout
    if run.idle_since is None:
        run.idle_since = now
        logger.warning(
            "run %s: no usable worker (connected: %s); waiting up to %.0f s", run.id, states or "none", timeout
        )
        run.events.emit("paused", cause="workers", why=f"no usable worker (connected: {len(states)})")
    elif now - run.idle_since > timeout:
        raise NoWorkersError(
            f"run {run.id} had no usable worker for {timeout:.0f} s "
            f"(no_worker_timeout; connected workers: {states or 'none'})"
        )
    run.no_workers = (
        f"no usable worker for {now - run.idle_since:.0f} s (connected: {len(states)}; no_worker_timeout={timeout:g} s)"
    )


async def idle(run: Run) -> None:
    """Nothing in flight: wait for usable workers, for the store, or find the run stuck."""
    parked = run.outage.holding() or run.dispatch.returned or run.dispatch.parked_validations
    if run.pool.usable() and not parked and run.dispatch.exhausted():
        raise RuntimeError(
            f"run {run.id} has nothing left to run or wait for, but epoch {len(run.ledger.epochs) + 1} is not complete"
        )
    await asyncio.sleep(INTERVAL)
