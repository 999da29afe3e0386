"""The embedded cluster's worker processes ignore SIGINT and SIGTERM: a worker preload (:data:`PRELOAD`).

They share the process group of the process that started them, so Ctrl-C in a terminal (SIGINT to the whole
group) or a ``timeout -s TERM`` (which signals the group too) reached them as well: they died, and ``fit``,
stopping its run on that same signal, waited its whole ``interrupt-grace`` for a final validation no worker
was left to run.  The process that started them stops their runs and closes them itself
(:func:`vcdask.cluster.close_embedded`: a stop message to each, then SIGKILL for one that does not stop).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
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


def with_preload(given: Any = None) -> list[str]:
    """The worker preloads of the embedded cluster: ``given`` (``LocalCluster(preload=...)``), else
    ``distributed.worker.preload``, and :data:`PRELOAD`."""
    import dask.config

    preloads = given if given is not None else dask.config.get("distributed.worker.preload")
    preloads = [preloads] if isinstance(preloads, str) else list(preloads or ())
    return preloads if PRELOAD in preloads else [*preloads, PRELOAD]


@contextlib.contextmanager
def sigterm_ignored_in_children() -> Iterator[None]:
    """SIGTERM ignored by this process while the block starts a child (the fork server), which keeps it
    ignored across ``exec``: a ``timeout -s TERM`` to the group then leaves the fork server and the workers
    forked from it alone (it ignores SIGINT itself).  Off the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
