"""Worker processes forked from a server that has PyTorch imported (vcdask.cluster.start_forkserver)."""

from __future__ import annotations

import dask.config
import pytest
from distributed import Client

from vcdask.cluster import WORKER_MODULES, embedded_cluster, start_forkserver

pytestmark = pytest.mark.cluster


def _probe(modules: tuple[str, ...]):
    """A function for ``client.run`` that imports nothing on the worker (cloudpickle sends a nested
    function by value; a module-level one of this file would import the file, and vcdask with it)."""

    def state() -> dict:
        import os
        import sys

        return {
            "modules": [m for m in modules if m in sys.modules],
            "malloc_trim": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        }

    return state


def test_forked_workers_start_with_torch_imported():
    """Before any task, and again after the nanny restarted them: PyTorch, torch._dynamo and the shard
    task's module are imported; the environment is distributed's, less MALLOC_TRIM_THRESHOLD_."""
    assert dask.config.get("distributed.worker.multiprocessing-method") == "forkserver"  # conftest.py
    expected = {"modules": list(WORKER_MODULES), "malloc_trim": None, "omp_threads": "1"}
    with embedded_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as client:
        assert list(client.run(_probe(WORKER_MODULES)).values()) == [expected, expected]
        client.restart()
        assert list(client.run(_probe(WORKER_MODULES)).values()) == [expected, expected]


def test_spawned_workers_import_afresh():
    """Dask's default start method is left alone: a spawned worker has not imported PyTorch."""
    with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
        start_forkserver()  # does nothing under spawn
        with embedded_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
            (state,) = client.run(_probe(WORKER_MODULES)).values()
    assert "torch" not in state["modules"]
