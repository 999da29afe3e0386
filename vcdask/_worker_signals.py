"""The embedded cluster's worker processes ignore SIGINT and SIGTERM: a worker preload (:data:`PRELOAD`).

They share the process group of the process that started them, so Ctrl-C in a terminal (SIGINT to the whole
group) or a ``timeout -s TERM`` (which signals the group too) reached them as well: they died, and ``fit``,
stopping its run on that same signal, waited its whole ``interrupt-grace`` for a final validation no worker
was left to run.  The process that started them stops their runs and closes them itself
(:func:`vcdask.cluster.close_embedded`: a stop message to each, then SIGKILL for one that does not stop).
"""

from __future__ import annotations

from typing import Any

#: The preload (``distributed.worker.preload`` takes a module's text as well as its name): text, so that a
#: spawned worker imports neither vcdask nor PyTorch to start.  In a worker process of a nanny (never in the
#: process that started the cluster, where a worker in a thread runs its preloads too), SIGINT and SIGTERM
#: are ignored from its start on.
PRELOAD = """
import multiprocessing, signal, threading

def dask_setup(worker):  # vcdask: the embedded cluster's workers ignore the group's Ctrl-C and SIGTERM
    if multiprocessing.parent_process() is None or threading.current_thread() is not threading.main_thread():
        return
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
"""


def with_preload_argv(preloads: list[str], given: Any = None) -> Any:
    """The preloads' arguments for ``preloads`` (:func:`with_preload`'s): ``given``
    (``LocalCluster(preload_argv=...)``), else ``distributed.worker.preload-argv``; a list of lists (one per
    preload, as distributed documents it) gets an empty one for :data:`PRELOAD`, or distributed refuses the
    mismatched lengths and no worker starts.  A flat list is every preload's: left as it is."""
    import dask.config

    argv = given if given is not None else dask.config.get("distributed.worker.preload-argv")
    if argv and not isinstance(argv[0], str) and len(argv) == len(preloads) - 1:
        return [*argv, []]
    return argv


def with_preload(given: Any = None) -> list[str]:
    """The worker preloads of the embedded cluster: ``given`` (``LocalCluster(preload=...)``), else
    ``distributed.worker.preload``, and :data:`PRELOAD`."""
    import dask.config

    preloads = given if given is not None else dask.config.get("distributed.worker.preload")
    preloads = [preloads] if isinstance(preloads, str) else list(preloads or ())
    return preloads if PRELOAD in preloads else [*preloads, PRELOAD]
