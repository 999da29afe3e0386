"""Warm worker processes: import what a shard task's first steps would import, before the task runs.

A fresh worker pays for ``import torch`` when it unpickles a run's spec, and for ``torch._dynamo`` when
the first optimizer is built (``torch.optim.Optimizer.__init__`` imports it lazily): 1.2 s each on an
idle core of the 2-core benchmark machine, about 3 s each when two cold workers and the client share the
cores.  Started in a background thread when a worker starts (the embedded cluster preloads this module)
or when a run begins (:class:`WarmImports`, registered by ``fit``), the imports overlap the cluster's
start and the run's staging instead of the first shard task.

Only third-party modules are imported here, never vcdask's own: a task that imports vcdask while this
thread imports torch waits for it, and neither import waits for the other.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

__all__ = ["WARM_MODULES", "WarmImports", "dask_setup", "start_warm_imports"]

#: Imported in the background on every worker.
WARM_MODULES = ("torch", "torch._dynamo")

logger = logging.getLogger(__name__)
_started = threading.Event()


def _import_all() -> None:
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - only a head start: the task imports (and fails) itself
            logger.debug("vcdask: could not pre-import %s: %r", name, exc)


def start_warm_imports() -> threading.Thread | None:
    """Start the imports in a daemon thread, once per process; return it (None if already started)."""
    if _started.is_set():
        return None
    _started.set()
    thread = threading.Thread(target=_import_all, name="vcdask-warm-imports", daemon=True)
    thread.start()
    return thread


def dask_setup(worker: Any) -> None:  # noqa: ARG001 - the hook's signature
    """Dask preload hook (``LocalCluster(preload=["vcdask._warm"])``): warm up as the worker starts."""
    start_warm_imports()


class WarmImports(WorkerPlugin):
    """Warm every worker of a cluster, those there now and those that join later (``fit`` registers it)."""

    name = "vcdask-warm-imports"
    idempotent = True

    def setup(self, worker: Any) -> None:
        start_warm_imports()
