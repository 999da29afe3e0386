"""The fork server that the embedded cluster's worker processes are forked from, and their environment.

Under Dask's ``forkserver`` start method (``distributed.worker.multiprocessing-method``), :func:`start_forkserver`
starts the server with PyTorch and vcdask's worker imported (:data:`WORKER_MODULES`), so that a worker starts
in a fraction of a second; :func:`torch_friendly_environ` is the environment it and the spawned workers get
(distributed's, less ``MALLOC_TRIM_THRESHOLD_``).  Both are re-exported by :mod:`vcdask.cluster`, where
:func:`~vcdask.cluster.embedded_cluster` calls them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["WORKER_MODULES", "start_forkserver", "torch_friendly_environ"]

#: What a shard task imports.  Under the ``forkserver`` start method the fork server imports them once,
#: and every worker process is forked with them loaded (:func:`start_forkserver`).
WORKER_MODULES = ("torch", "torch._dynamo", "vcdask.worker")


def start_forkserver() -> None:
    """Start the fork server that worker processes are forked from, with PyTorch and vcdask's worker
    imported, when ``distributed.worker.multiprocessing-method`` is ``"forkserver"``.

    A spawned worker process imports PyTorch afresh, and its first shard imports ``torch._dynamo``
    (``torch.optim`` does): 5-7 s of CPU each time a worker starts or a nanny restarts one.  Forked from
    a server that has them, a worker starts in a fraction of a second.  :func:`embedded_cluster` calls
    this; call it before you start a ``LocalCluster`` of your own with that setting.  Under Dask's
    default (``spawn``) it does nothing, and once the fork server runs (a cluster of this process
    started it) it changes nothing.

    The server's environment is the one distributed gives spawned workers
    (``distributed.nanny.pre-spawn-environ``, less ``MALLOC_TRIM_THRESHOLD_``: see
    :func:`torch_friendly_environ`); forked workers get no other, as that setting's documentation warns.
    """
    import multiprocessing.forkserver
    import os

    import dask.config
    from distributed.utils import get_mp_context

    if dask.config.get("distributed.worker.multiprocessing-method") != "forkserver":
        return
    get_mp_context().set_forkserver_preload(["distributed", *WORKER_MODULES])  # after distributed's own
    environ = {k: str(v) for k, v in torch_friendly_environ().items()}
    saved = {k: os.environ.get(k) for k in [*environ, "MALLOC_TRIM_THRESHOLD_"]}
    os.environ.update(environ)
    os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)
    try:
        # (not started with SIGTERM ignored: forkserver.main restores only SIGINT and SIGCHLD, so every process
        # forked from it, a user's own LocalCluster's workers too, would ignore SIGTERM; the embedded cluster's
        # workers ignore it through their preload)
        multiprocessing.forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
