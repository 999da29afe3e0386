"""Watching the pool and the copies in flight: whether a usable worker is there, when each copy starts,
when one is overdue, and preemption notices.

Functions of the :class:`~.state.RunState`.

Preemption (``vcdask.preempt(client, worker, window=...)``, or a :class:`vcdask.cloud.PreemptionWatcher`
that reads the provider's notice on the worker): :func:`preempt` drains the worker (no new shards);
a copy queued there, not started, is re-issued elsewhere at once; a running copy keeps going when its
expected remaining time (the median of the worker's recent shard times this run, else the run's) fits
the notice window with margin (:func:`~vcdask.engine.policy.fits_notice`), otherwise, or when nothing
is known, it is re-issued at once.  A kept copy still running there when only the margin is left is
re-issued then (:func:`settle`).  None of this counts against the worker or the shard.
"""

from __future__ import annotations

import logging
import statistics

from .. import policy
from .dispatching import submit_shard, submit_validation, validation_deadline
from .failures import fail, move_queued_off, overdue
from .messages import Cancel
from .rejections import diverging
from .state import RunState

__all__ = ["check_workers", "deadlines", "nothing_left", "preempt", "settle", "started"]

logger = logging.getLogger(__name__)


def started(state: RunState, key: str, worker: str) -> None:
    """A task began to run on ``worker``: its deadline counts from now."""
    task = state.tasks.records.get(key)
    if task is None:
        return
    task.started, task.worker = state.clock(), worker
    if task.kind == "update":
        state.ledger.set_shard(task.epoch, task.shard, "running" if task.attempt == 0 else "re-issued")


def check_workers(state: RunState) -> None:
    """Track whether a usable worker is connected.  Without one the run waits (tasks already
    submitted stay queued at the scheduler) and fails once it has waited ``no_worker_timeout``."""
    now = state.clock()
    if state.pool.usable():
        if state.idle_since is not None:
            logger.warning("run %s: usable workers again after %.0f s", state.id, now - state.idle_since)
            state.emit("resumed", cause="workers", after=now - state.idle_since)
            for task in state.tasks.records.values():  # copies queued meanwhile start their clocks now
                if task.started is None:
                    task.submitted = now
        state.idle_since, state.no_workers = None, None
        return
    states = state.pool.unusable()
    cause = state.pool.cause()  # (e.g. "every worker is paused by Dask's memory manager (...)")
    if (likely := diverging(state)) is not None:  # (the workers sent NaN from the first version on)
        cause = f"{cause}; {likely}"
    timeout = state.res.no_worker_timeout
    if state.idle_since is None:
        state.idle_since = now
        logger.warning(
            "run %s: no usable worker: %s (connected: %s); waiting up to %.0f s",
            state.id,
            cause,
            states or "none",
            timeout,
        )
        state.emit("paused", cause="workers", why=f"no usable worker: {cause} (connected: {len(states)})")
    elif now - state.idle_since > timeout:
        fail(
            state,
            "no_workers",
            f"run {state.id} had no usable worker for {timeout:.0f} s "
            f"(no_worker_timeout; connected workers: {states or 'none'})" + (f": {cause}" if states else ""),
        )
        return
    state.no_workers = (
        f"no usable worker for {now - state.idle_since:.0f} s: {cause} (connected: {len(states)}; "
        f"no_worker_timeout={timeout:g} s)"
    )


def nothing_left(state: RunState) -> None:
    """Nothing is in flight: fail if nothing is left to run or wait for while an epoch is incomplete."""
    dispatch = state.dispatch
    parked = state.outage.holding() or dispatch.returned or dispatch.parked_validations
    out = state.tasks.records or state.tasks.handed
    if state.pool.usable() and not parked and not out and dispatch.exhausted() and not state.finished():
        fail(
            state,
            "stuck",
            f"run {state.id} has nothing left to run or wait for, "
            f"but epoch {len(state.ledger.epochs) + 1} is not complete",
        )


#: A copy Dask holds for workers that all left (:meth:`~vcdask.engine.inflight.TaskTable.stranded`): sent
#: again to the workers connected now, without blame, as soon as one of them is usable.
STRANDED = policy.Overdue("was queued for workers that all left", blame=False)


def deadlines(state: RunState) -> list[str]:
    """Re-issue shard copies that run past their deadline or fall too far behind, and the ones queued
    behind a late copy; validate again elsewhere the versions whose validation is late.  Returns the
    keys of the copies of merged shards that no worker is running (for the shell to cancel)."""
    if state.stopping:
        return []
    ledger, tasks = state.ledger, state.tasks
    tps = state.spec.tasks_per_slot
    warm = policy.deadline(state.res, ledger.shard_seconds, tps)
    # copies of merged shards that no worker is running (e.g. theirs died); not a finished one: its
    # result is on its way back to the run, to be recorded for what it is (late), not as cancelled
    redundant = [
        k
        for k, t in tasks.updates()
        if ledger.is_merged(t.epoch, t.shard)
        and tasks.processing_on(k) is None
        and tasks.state(k) not in ("memory", "erred")
    ]
    if not state.pool.usable():
        return redundant  # nowhere to re-issue to: copies wait at the scheduler for workers to join
    stale_after = state.staleness_limit()
    now = state.clock()
    room = state.pool.room()
    for key, task in tasks.updates():
        if task.overdue or ledger.is_merged(task.epoch, task.shard) or key not in tasks.records:
            continue
        if task.started is None and tasks.stranded(key, state.pool.connected):
            overdue(state, task, STRANDED, None)  # (now: it would wait out its "never started" patience)
            if state.failure is not None:
                return redundant
            continue
        limit = (
            policy.deadline(state.res, ledger.shard_seconds, tps, cold=True) if state.pool.cold(task.worker) else warm
        )
        running_on = tasks.processing_on(key)
        verdict = policy.overdue(
            now=now,
            # a copy started only as far as the hand-over before it knows is waited for as a queued one
            submitted=task.started if task.handed and task.started is not None else task.submitted,
            started=None if task.handed else task.started,
            running_on=running_on,
            worker=task.worker,
            # a copy that has not asked for its base yet will train from the newest version
            behind=state.head.step - task.step if task.based else 0,
            stale_after=stale_after,
            limit=limit,
            patience=warm * (tps + 2),
            room=room,
            draining=task.worker in state.pool.draining,
        )
        if verdict == "restart":  # its worker died: Dask is moving it, it starts afresh (its work there lost)
            # (an overdue copy is not here: its work was counted when it was re-issued)
            state.pool.lost(task.worker, 0.0 if task.started is None else now - task.started)
            task.started, task.submitted, task.based = None, now, False
        elif verdict is not None:
            where = task.worker if verdict.blame and task.began else running_on
            overdue(state, task, verdict, where)
            if state.failure is not None:
                return redundant
            if verdict is policy.NEVER_STARTED:
                replaced(state, key)
    stuck = state.stuck_workers()
    move_queued_off(state, stuck)  # queued behind a late copy
    late_validations(state, now, stuck, patience=warm * (tps + 2), room=room)
    return redundant


def replaced(state: RunState, key: str) -> None:
    """The copy ``key`` never started, and was sent again: it is cancelled (not left queued beside its
    replacement), so at most one copy of a shard or a validation waits to start.  Left queued, one more
    copy every patience piled up at the scheduler while another client's tasks held every thread."""
    task = state.tasks.pop(key)
    if task is None:
        return
    if task.kind == "update":
        state.ledger.record_copy(task, "cancelled", "cancelled: it never started; sent again")
    state.out.append(Cancel((key,)))


def late_validations(state: RunState, now: float, stuck: set[str], patience: float, room: bool = True) -> None:
    """Run every late validation again elsewhere: one past its deadline, one that never started within
    ``patience`` (the shard copies') while a usable worker has a free thread (``room``; that copy is
    cancelled: :func:`replaced`), and one waiting to start on a ``stuck`` worker.  The late one is left
    alone (not cancelled): while it is processing on a frozen worker, the scheduler counts that worker's
    slot as taken and sends it nothing else.

    An epoch closes only once its end version is validated, so a validation that never comes back
    would hold the whole run (a frozen worker stays connected until Dask's ``worker-ttl``, minutes).
    The first result for a version counts; a late one is ignored."""
    for key, task in list(state.tasks.records.items()):
        if task.kind != "validation" or task.overdue or task.step in state.ledger.validations:
            continue
        running_on = state.tasks.processing_on(key)
        verdict: policy.Overdue | str | None
        if task.started is None and running_on is not None and running_on in stuck:
            verdict = policy.Overdue(f"queued on {running_on}, which is stuck", blame=False)
        elif task.started is None and state.tasks.stranded(key, state.pool.connected):
            verdict = STRANDED
        else:
            verdict = policy.overdue(
                now=now,
                submitted=task.submitted,
                started=task.started,
                running_on=running_on,
                worker=task.worker,
                behind=0,
                stale_after=None,
                limit=validation_deadline(state, task.worker),
                patience=patience,
                room=room,
            )
        if verdict == "restart":  # its worker died: Dask is moving it, it starts afresh
            task.started, task.submitted = None, now
            continue
        if not isinstance(verdict, policy.Overdue):
            continue
        task.overdue = True
        where = task.worker if task.started is not None else running_on
        logger.warning(
            "run %s: the validation of version %d %s; validating it again elsewhere", state.id, task.step, verdict.why
        )
        submit_validation(state, task.version, task.step, retry=task.attempt + 1, avoid={where} if where else set())
        if verdict is policy.NEVER_STARTED:
            replaced(state, key)


def expected_seconds(state: RunState, address: str) -> float | None:
    """A shard's expected time on ``address``: the median of its recent ones this run (its first, cold
    task weighs little once it has done a few), else the run's median, else None."""
    rec = state.pool.records.get(address)
    if rec is not None and rec.recent:
        return statistics.median(rec.recent)
    return state.ledger.shard_seconds.median() if state.ledger.shard_seconds else None


def _move(state: RunState, key: str, address: str) -> str | None:
    task = state.tasks.records.get(key)
    if task is None or task.overdue or state.ledger.is_merged(task.epoch, task.shard):
        return None
    task.overdue = True  # its slot is free; if it still finishes, the first result wins
    if task.began and task.worker == address:  # its work so far is lost with the instance
        state.pool.wasted(address, state.clock() - (task.started or state.clock()))
    return submit_shard(state, task.epoch, task.shard, avoid=address)


def preempt(state: RunState, address: str, window: float | None = None) -> tuple[list[str], list[str]]:
    """A notice that ``address`` will be reclaimed in ``window`` seconds (None: at once, or unknown).

    Returns ``(reissued, kept)``: the keys of the copies re-issued elsewhere, and of the copies
    running there that are let finish.  Not counted as failures.
    """
    state.pool.drain(address)
    wasted_before = state.pool.record(address).wasted_seconds
    moved, kept = [], []
    expected = expected_seconds(state, address)
    now = state.clock()
    for key, task in state.tasks.updates():
        if state.tasks.processing_on(key) != address or task.overdue:
            continue
        on_it = task.began and task.worker == address
        if (
            window is not None
            and on_it
            and expected is not None
            and policy.fits_notice(expected, now - (task.started or now), window)
        ):
            kept.append(key)
            continue
        new = _move(state, key, address)
        if new is not None:
            moved.append(new)
    state.emit(
        "preempted",
        worker=address,
        reissued=len(moved),
        kept=len(kept),
        wasted_seconds=state.pool.record(address).wasted_seconds - wasted_before,
        kept_copies=[[t.epoch, t.shard, t.attempt] for t in map(state.tasks.records.get, kept) if t is not None],
        window=window,
        worker_row=state.pool.record(address).as_row(),
    )
    return moved, kept


def still_running(state: RunState, address: str, kept: tuple[str, ...]) -> list[str]:
    """The ``kept`` copies the scheduler still has processing on ``address``."""
    return [k for k in kept if k in state.tasks.records and state.tasks.processing_on(k) == address]


def settle(state: RunState, address: str, kept: tuple[str, ...]) -> list[str]:
    """The notice's margin is reached: re-issue the ``kept`` copies still running on ``address``; their new keys."""
    moved = [new for new in (_move(state, k, address) for k in still_running(state, address, kept)) if new is not None]
    if moved:
        state.emit("preempted", worker=address, reissued=len(moved), kept=0, window=0.0)
    return moved
