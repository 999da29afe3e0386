"""Preemption notices: telling a scheduler's vcdask runs that a worker is about to be reclaimed.

:func:`preempt` sends the notice by hand (``vcdask.preempt``), :func:`preemption_notice` from the worker that
is going, and :func:`notify_runs` hands it to the scheduler's vcdask plugin (retiring the worker itself on a
scheduler where no run started); :class:`vcdask.cloud.PreemptionWatcher` calls it when the provider's notice
arrives.  All three are re-exported by :mod:`vcdask.cluster`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger("vcdask.cluster")  # (the logger they logged to in vcdask.cluster, where they were)

__all__ = ["notify_runs", "preempt", "preemption_notice"]


def preempt(client: Any, worker: str, *, retire: bool = True, window: float | None = None) -> dict[str, list[str]]:
    """Tell every vcdask run that ``worker`` is about to be reclaimed (a spot/preemptible notice).

    The runs stop giving it shards and re-issue the shards queued on it elsewhere (not counted
    as failures).  With ``window`` (seconds until the instance goes), a shard running there is let
    finish when its expected remaining time fits the window with margin, and re-issued otherwise;
    without it, every shard there is re-issued at once.  With ``retire=True`` the worker is then
    retired gracefully (after the shards let finish).  :class:`vcdask.cloud.PreemptionWatcher`
    calls this when the provider's notice arrives (AWS: two minutes ahead; GCP, Azure: 30 s).
    On a scheduler where no vcdask run has started, there is nothing to tell: with ``retire=True``
    the worker is retired gracefully all the same.

    Parameters
    ----------
    client : distributed.Client
        A client of the scheduler the runs live on.
    worker : str
        The worker's address.
    retire : bool, default True
        Retire the worker once the shards let finish there are done.
    window : float, optional
        Seconds until the instance goes.  Default: every shard there is re-issued at once.

    Returns
    -------
    dict
        run id -> keys of the shard copies re-issued (empty on a scheduler without vcdask runs).
    """
    return client.sync(notify_runs, client.scheduler, worker, retire=retire, window=window)


def preemption_notice(*, retire: bool = True, window: float | None = None) -> dict[str, list[str]]:
    """:func:`vcdask.preempt` for the worker this code runs on (call it from a task or a worker plugin)."""
    from distributed import get_worker
    from distributed.utils import sync

    worker = get_worker()
    return sync(worker.loop, notify_runs, worker.scheduler, worker.address, retire=retire, window=window)


async def notify_runs(
    scheduler: Any,
    worker: str,
    *,
    retire: bool,
    window: float | None,
    reason: str = "",
    timeout: float | None = None,
) -> dict[str, list[str]]:
    """Hand a preemption notice for ``worker`` to the vcdask runs of the scheduler that ``scheduler`` (a client's
    or a worker's connection to it) reaches, waiting ``timeout`` seconds at most for its answer; on a scheduler
    whose vcdask plugin was never registered (no run started there), retire the worker (``retire``) as the
    plugin would, and hand back no re-issued copies.

    Dask answers a request for a handler it lacks with None (and logs "No handler vcdask_preempt found");
    vcdask's own handler always answers a dict.
    """
    ask = scheduler.vcdask_preempt(worker=worker, retire=retire, window=window, reason=reason)
    moved = await (ask if timeout is None else asyncio.wait_for(ask, timeout))
    if moved is not None:
        return moved
    logger.info("preemption notice for %s: no vcdask run on its scheduler%s", worker, "; retiring it" if retire else "")
    if retire:
        await scheduler.retire_workers(workers=[worker], close_workers=True, stimulus_id=f"vcdask-preempt-{worker}")
    return {}
