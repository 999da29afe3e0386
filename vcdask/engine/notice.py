"""Preemption notices: a worker that will be reclaimed drains, then retires.

``vcdask.preempt(client, worker, window=...)``, or a :class:`vcdask.cloud.PreemptionWatcher` that reads
the provider's notice on the worker, reaches :meth:`VcdaskPlugin.handle_preempt`, which calls
:func:`preempt` for every live run, then :func:`settle` and the scheduler's ``retire_workers``:

* the worker gets no new shards (the pool drains it);
* a copy queued there, not started, is re-issued elsewhere at once;
* a running copy keeps going when its expected remaining time (the median of the worker's recent shard
  times this run, else the run's) fits the notice window with margin
  (:func:`~vcdask.engine.policy.fits_notice`); otherwise, or when nothing is known, it is re-issued at
  once.  A kept copy that has not finished when only the margin is left is re-issued then;
* once no kept copy runs there, the worker retires (Dask moves any result it still holds).

None of this counts against the worker or the shard: a re-issued copy is a copy, and the first
result of a shard to arrive is merged, the other recorded as superseded.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import TYPE_CHECKING

from . import policy

if TYPE_CHECKING:
    from .run import Run

__all__ = ["preempt", "settle"]

#: How often :func:`settle` looks at the copies it lets finish (seconds).
POLL = 0.05


def expected_seconds(run: Run, address: str) -> float | None:
    """A shard's expected time on ``address``: the median of its recent ones this run (its first, cold
    task weighs little once it has done a few), else the run's median, else None."""
    rec = run.pool.records.get(address)
    if rec is not None and rec.recent:
        return statistics.median(rec.recent)
    return statistics.median(run.ledger.shard_seconds) if run.ledger.shard_seconds else None


def _move(run: Run, key: str, address: str) -> str | None:
    task = run.tasks.tasks.get(key)
    if task is None or task.overdue or run.ledger.is_merged(task.epoch, task.shard):
        return None
    task.overdue = True  # its slot is free; if it still finishes, the first result wins
    if task.started is not None and task.worker == address:  # its work so far is lost with the instance
        run.pool.wasted(address, time.monotonic() - task.started)
    return run.submit_shard(task.epoch, task.shard, avoid=address)


def preempt(run: Run, address: str, window: float | None = None) -> tuple[list[str], list[str]]:
    """A notice that ``address`` will be reclaimed in ``window`` seconds (None: at once, or unknown).

    Returns ``(reissued, kept)``: the keys of the copies re-issued elsewhere, and of the copies
    running there that are let finish.  Not counted as failures.
    """
    run.pool.drain(address)
    wasted_before = run.pool.record(address).wasted_seconds
    moved, kept = [], []
    expected = expected_seconds(run, address)
    now = time.monotonic()
    for key, task in run.tasks.updates():
        if run.tasks.processing_on(key) != address or task.overdue:
            continue
        started = task.started is not None and task.worker == address
        if (
            window is not None
            and started
            and expected is not None
            and policy.fits_notice(expected, now - (task.started or now), window)
        ):
            kept.append(key)
            continue
        new = _move(run, key, address)
        if new is not None:
            moved.append(new)
    run.events.emit(
        "preempted",
        worker=address,
        reissued=len(moved),
        kept=len(kept),
        wasted_seconds=run.pool.record(address).wasted_seconds - wasted_before,
        kept_copies=[[t.epoch, t.shard, t.attempt] for t in map(run.tasks.tasks.get, kept) if t is not None],
        window=window,
        worker_row=run.pool.record(address).as_row(),
    )
    return moved, kept


async def settle(run: Run, address: str, kept: list[str], deadline: float) -> list[str]:
    """Wait until none of the ``kept`` copies runs on ``address`` any more, or until ``deadline``
    (``time.monotonic()``); then re-issue the ones still running there.  Returns their new keys."""
    left = list(kept)
    while left and not run.done.is_set():
        left = [k for k in left if k in run.tasks.tasks and run.tasks.processing_on(k) == address]
        if not left or time.monotonic() >= deadline:
            break
        await asyncio.sleep(POLL)
    moved = [new for new in (_move(run, k, address) for k in left) if new is not None]
    if moved:
        run.events.emit("preempted", worker=address, reissued=len(moved), kept=0, window=0.0)
    return moved
