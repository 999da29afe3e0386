"""How many workers the live runs could use: what Dask's adaptive scaling (``cluster.adapt``) is told.

Dask sizes an adaptive cluster by the tasks it holds (:meth:`distributed.Scheduler.adaptive_target`): the
queued ones and those processing, never more workers than tasks.  A run keeps one shard copy per worker
slot in flight and queues none at the scheduler (its shards wait in the run's own queue, to go to the
worker that frees a slot, from the newest version), so Dask never saw more work than the workers it had:
``cluster.adapt(minimum=1, maximum=8)`` stayed at one worker for a whole run, and a spot fleet scaled
down while the data was staged never grew again.  The plugin adds the runs' own demand to Dask's target
(:func:`install`): a run could use a slot for every shard it still has to train, up to one epoch's
shards (more workers than shards only overlaps epochs: the updates grow staler, not the run faster).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["install", "slots_wanted", "workers_wanted"]


def slots_wanted(state: Any) -> int:
    """Worker slots the run could keep busy now: the shards it has yet to train (those in flight included),
    at most ``n_shards``; none once it is stopping or finished."""
    if state.stopping is not None or state.finished():
        return 0
    ledger = state.ledger
    first = max(1, state.dispatch.epoch)
    left = sum(ledger.remaining(e) for e in range(first, ledger.max_epochs + 1))
    return min(left, ledger.n_shards)


def workers_wanted(states: Iterable[Any], nthreads: Iterable[int]) -> int:
    """Workers the runs ``states`` could use, given the threads of the workers there are (``nthreads``; one
    a worker when there are none: a new worker's size is not known)."""
    threads = list(nthreads)
    per_worker = sum(threads) / len(threads) if threads else 1.0
    slots = sum(slots_wanted(s) for s in states)
    return math.ceil(slots / max(per_worker, 1.0)) if slots else 0


def install(scheduler: Any, runs: Callable[[], Iterable[Any]]) -> None:
    """Make ``scheduler``'s adaptive target (its method, and the handler :class:`distributed.Adaptive`
    calls) the larger of Dask's own and what the live runs (``runs()``: their core states) could use."""
    dask_target = scheduler.adaptive_target

    def adaptive_target(target_duration: Any = None) -> int:
        nthreads = [ws.nthreads for ws in scheduler.workers.values()]
        return max(dask_target(target_duration), workers_wanted(runs(), nthreads))

    scheduler.adaptive_target = adaptive_target
    scheduler.handlers["adaptive_target"] = adaptive_target
