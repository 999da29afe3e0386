"""Worker processes with the environment a test sets: spawned, not forked from the test session's fork server."""

from __future__ import annotations

from typing import Any


def spawned_cluster(**kwargs: Any):
    """A LocalCluster of one worker process (``kwargs`` for more) started with this process's environment now.

    The test session's workers are forked from a fork server (tests/conftest.py), which has the environment of
    when it started: an earlier test's credentials (the ``s3`` fixture's), which a test of workers without any
    must not find there."""
    import dask
    from distributed import LocalCluster

    options = {"n_workers": 1, "threads_per_worker": 1, "processes": True, "dashboard_address": ":0", **kwargs}
    with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
        return LocalCluster(**options)
