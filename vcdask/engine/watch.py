"""Watching the pool and the copies in flight: whether a usable worker is there, when each copy starts
(and from which version), and when one is overdue.

Functions of the :class:`~vcdask.engine.run.Run` (the event loop only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from ..errors import NoWorkersError
from . import faults, policy, validations

if TYPE_CHECKING:
    from .run import Run

__all__ = ["INTERVAL", "base_for", "check_workers", "deadlines", "idle", "in_use_step", "next_base", "task_started"]

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


async def base_for(run: Run, key: str, worker: str | None = None) -> dict[str, Any] | None:
    """The version a shard task that is ready to train should start from: the newest committed one,
    once the results that came back before it asked are merged (waiting at most
    :func:`~vcdask.engine.policy.base_wait`).

    A task asks once it has read the run's spec and its rows, so the time a copy waited in a queue
    or spent warming up a cold worker is not counted as staleness (a healthy run's first updates
    were once rejected as stale for it).  A worker gets its next shard as soon as its result is back,
    before that result is merged: without the wait, its next task would train from the version just
    before its own update, every time (half of the work lost with ``alpha=0``; one step staler with
    every rule).  With ``vcdask.worker.overlap="delta"`` the worker does not wait for this answer: its
    next task trains meanwhile and corrects its weights once the answer is there (:mod:`vcdask.overlap`);
    with ``"newest"`` the answer does not wait for the merges due.

    Returns ``{"version": ..., "step": ...}``, or ``{"abandon": True}`` for a copy the run no longer
    waits for: cancelled, or a finished one that Dask runs again because the worker holding its result
    died (the run read that result from the store, :mod:`.results`); it would train for nothing and
    overwrite the update the run merges.  A base also has

    - ``"params"``: its parameters packed by :func:`vcdask._wire.pack`, when they are at most
      ``vcdask.worker.inline-base-bytes``; ``"version"`` is None for such parameters given as they
      were merged, while the merge thread commits them as the version of ``"step"``
      (``vcdask.worker.base-before-commit``);
    - ``"fraction"``, with ``speed_adaptive``: the share of its shard's batches the task trains on ``worker``.
    """
    task = run.tasks.tasks.get(key)
    if task is None:
        return {"abandon": True}
    if task.kind != "update":
        return None
    waits = run.spec.overlap != "newest"  # (vcdask.overlap) "newest": the head as it is, without the merges due
    if waits and run.settled < run.arrived and not run.through(run.arrived):
        await run.settled_through(run.arrived, policy.base_wait(run.ledger.shard_seconds))
        task = run.tasks.tasks.get(key)
        if task is None:
            return {"abandon": True}
    head = run.server.head
    base: dict[str, Any]
    if head.draft is not None:  # merged, being committed: its version id does not exist yet
        base = {"version": None, "step": head.step, "params": head.draft}
    else:
        base = {"version": head.version, "step": head.version_step}
        if head.payload is not None:  # a small model: no store read for the worker
            base["params"] = head.payload
    task.step, task.based = base["step"], True
    worker = worker or task.worker
    if run.spec.speed_adaptive and worker:  # the share of its shard's batches a task there trains
        base["fraction"] = run.pool.work_fraction(worker)
    return base


async def next_base(run: Run, key: str, worker: str) -> dict[str, Any] | None:
    """The base of shard copy ``key``, just sent to ``worker`` to run there next, for the answer to the
    hand-over of the task finishing there (:meth:`~.run.Run.hand_over`): what :func:`base_for` would
    answer the copy once it starts, decided now, so a warm worker sends one message per task, not two.

    None when the copy started or was given up meanwhile, or when its shard's home is another worker
    (``worker`` reads its rows first, a while maybe: the copy asks for its base itself once it has
    them).  The caller records the copy as started on ``worker``: it starts as soon as the hand-over
    returns.
    """
    task = run.tasks.tasks.get(key)
    if task is None or task.kind != "update" or task.started is not None:
        return None
    if run.dispatch.home.get(task.shard) != worker:  # it reads its rows first: it asks once it has them
        return None
    base = await base_for(run, key, worker)
    task = run.tasks.tasks.get(key)
    if base is None or "abandon" in base or task is None or task.started is not None:
        return None
    return base


def in_use_step(run: Run) -> int:
    """The oldest version step the run's tasks may still read: the bases of the shard copies in flight
    and of the results handed over but not merged yet, the versions its validations measure, and the
    newest version (which the next copy gets).

    Published to the merge thread (``run.server.in_use_step``), whose retention keeps every version from
    there on.  A value read a while ago is only lower than the truth: versions handed out later are the
    newest committed one at the time, never older.
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
