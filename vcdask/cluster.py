"""Where runs execute: a given Dask client or cluster, or an embedded ``LocalCluster``.

Cloud fleets come from dask-cloudprovider (``pip install vcdask[cloud]``); pass the
cluster object to :func:`vcdask.fit` like any other.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["embedded_cluster", "preempt", "preemption_notice", "resolve_client"]


def embedded_cluster(n_workers: int | None = None, **kwargs: Any):
    """The embedded default: one worker process per core, one thread each.

    Parameters
    ----------
    n_workers : int, optional
        Number of worker processes (default: the number of cores).
    **kwargs
        Passed to :class:`distributed.LocalCluster`.
    """
    import dask.config
    from distributed import LocalCluster

    n = dask.system.CPU_COUNT if n_workers is None else n_workers  # honours affinity and cgroup limits
    kwargs.setdefault("threads_per_worker", 1)
    kwargs.setdefault("processes", True)
    kwargs.setdefault("dashboard_address", ":0")
    kwargs.setdefault("silence_logs", logging.ERROR)
    with dask.config.set({"distributed.nanny.pre-spawn-environ": torch_friendly_environ()}):
        return LocalCluster(n_workers=n, **kwargs)


def torch_friendly_environ() -> dict[str, Any]:
    """distributed's worker environment without ``MALLOC_TRIM_THRESHOLD_``.

    distributed sets ``MALLOC_TRIM_THRESHOLD_=65536`` in every worker so that freed memory
    goes back to the OS at once.  PyTorch's many short-lived allocations then page-fault on
    every step: the digits shard task trained in 46 ms instead of 27 ms (1.7x slower).  The
    embedded cluster leaves glibc's default; give your own clusters the same setting with
    ``distributed.nanny.pre-spawn-environ``.
    """
    import dask.config

    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    environ.pop("MALLOC_TRIM_THRESHOLD_", None)
    return environ


def check_client(client: Any) -> None:
    """Reject anything that is not a Dask Client, a cluster object or None (before any cluster work)."""
    if client is None:
        return
    from distributed import Client

    if isinstance(client, Client) or hasattr(client, "scheduler_address"):
        return
    raise TypeError(
        f"client must be a distributed.Client, a Dask cluster (LocalCluster, dask-cloudprovider ...) "
        f"or None for the embedded LocalCluster; got {type(client).__name__}"
    )


@contextlib.contextmanager
def resolve_client(client: Any) -> Iterator[Any]:
    """Yield a Client: the given one (left open), one for a given cluster (cluster left running),
    or one for a fresh embedded LocalCluster (closed on exit)."""
    from distributed import Client

    check_client(client)
    if isinstance(client, Client):
        yield client
    elif client is not None:
        with Client(client, set_as_default=False) as c:
            yield c
    else:
        with embedded_cluster() as cluster, Client(cluster, set_as_default=False) as c:
            logger.info("started an embedded LocalCluster: %s", cluster.dashboard_link)
            yield c


def preempt(client: Any, worker: str, *, retire: bool = True, window: float | None = None) -> dict[str, list[str]]:
    """Tell every vcdask run that ``worker`` is about to be reclaimed (a spot/preemptible notice).

    The runs stop giving it shards and re-issue the shards queued on it elsewhere (not counted
    as failures).  With ``window`` (seconds until the instance goes), a shard running there is let
    finish when its expected remaining time fits the window with margin, and re-issued otherwise;
    without it, every shard there is re-issued at once.  With ``retire=True`` the worker is then
    retired gracefully (after the shards let finish).  :class:`vcdask.cloud.PreemptionWatcher`
    calls this when the provider's notice arrives (AWS: two minutes ahead; GCP, Azure: 30 s).

    Returns
    -------
    dict
        run id -> keys of the shard copies re-issued.
    """
    return client.sync(client.scheduler.vcdask_preempt, worker=worker, retire=retire, window=window)


def preemption_notice(*, retire: bool = True, window: float | None = None) -> dict[str, list[str]]:
    """:func:`vcdask.preempt` for the worker this code runs on (call it from a task or a worker plugin)."""
    from distributed import get_worker
    from distributed.utils import sync

    worker = get_worker()
    return sync(worker.loop, worker.scheduler.vcdask_preempt, worker=worker.address, retire=retire, window=window)
