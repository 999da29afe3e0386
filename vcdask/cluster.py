"""Where runs execute: a given Dask client or cluster, or the process's embedded ``LocalCluster`` (inside a Dask
task, the task's own cluster, as ``distributed.get_client()`` gives it).

The embedded cluster is started by the first run that needs it and shared by every later one of the
process (:func:`embedded_client`), closed when the interpreter exits, as Dask's default client is.
Before it spawns worker processes, :func:`check_main_guard` refuses a script's unguarded top level.

The fork server that worker processes are forked from (:func:`start_forkserver`, :func:`torch_friendly_environ`)
lives in :mod:`vcdask._forkserver`, and the preemption notices (:func:`preempt`, :func:`preemption_notice`,
:func:`notify_runs`) in :mod:`vcdask._preemption`; both are re-exported here.

Cloud fleets come from dask-cloudprovider (``pip install vcdask[cloud]``); pass the
cluster object to :func:`vcdask.fit` like any other.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ._forkserver import WORKER_MODULES as WORKER_MODULES
from ._forkserver import start_forkserver, torch_friendly_environ
from ._main_guard import check_main_guard
from ._preemption import notify_runs, preempt, preemption_notice
from ._worker_signals import with_preload, with_preload_argv

logger = logging.getLogger(__name__)

__all__ = [
    "check_main_guard",
    "check_sync",
    "close_embedded",
    "embedded_client",
    "embedded_cluster",
    "in_task",
    "is_embedded",
    "live_runs",
    "notify_runs",
    "owns_client",
    "preempt",
    "preemption_notice",
    "resolve_client",
    "running_embedded_client",
    "start_forkserver",
]

_lock = threading.Lock()
_embedded: dict[str, Any] = {}  # "cluster", "client": the process's embedded LocalCluster and its Client


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
    if kwargs["processes"]:
        start_forkserver()
        kwargs["preload"] = with_preload(kwargs.get("preload"))  # workers ignore the group's Ctrl-C and SIGTERM
        kwargs["preload_argv"] = with_preload_argv(kwargs["preload"], kwargs.get("preload_argv"))
    with dask.config.set({"distributed.nanny.pre-spawn-environ": torch_friendly_environ()}):
        return _started(lambda: LocalCluster(n_workers=n, **kwargs))


def _started(start: Callable[[], Any]) -> Any:
    """``start()`` (a cluster's start) in a thread of its own, so that Ctrl-C while it starts cannot leave a
    cluster half-started behind: distributed goes on starting its workers on its event loop, and the next
    cluster would be a second one.  Ctrl-C waits for the start to end, closes what it started, and raises the
    ``KeyboardInterrupt``; a second Ctrl-C leaves at once."""
    started: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            started.set_result(start())
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            started.set_exception(e)

    threading.Thread(target=run, name="vcdask-cluster-start", daemon=True).start()
    try:
        return started.result()
    except KeyboardInterrupt:
        print("vcdask: interrupted while the cluster starts: closing it once it is up (Ctrl-C again to leave now)",
              file=sys.stderr, flush=True)  # fmt: skip
        try:
            cluster = started.result()
        except Exception:  # noqa: BLE001 - it did not start: nothing to close
            cluster = None
        if cluster is not None:
            _close(cluster)
        raise


def check_client(client: Any) -> None:
    """Reject anything that is not a Dask Client, a cluster object, a scheduler address or None (before any
    cluster work), and a client or cluster that is asynchronous where it is given (:func:`check_sync`).

    Raises
    ------
    TypeError
        Another kind of object; an asynchronous client or cluster, given from its event loop.
    ValueError
        A string that is no scheduler address (``"tcp://host:8786"``, ``"host:8786"``).
    """
    if client is None:
        return
    from distributed import Client
    from distributed.comm.addressing import get_address_host_port, parse_address

    if isinstance(client, Client) or hasattr(client, "scheduler_address"):
        check_sync(client)
        return
    if isinstance(client, str):
        try:
            scheme, _ = parse_address(client)
            if scheme != "inproc":  # (an in-process scheduler's address has no port)
                get_address_host_port(client)
        except ValueError as e:
            raise ValueError(
                f"client={client!r} is not a scheduler address such as 'tcp://10.0.0.5:8786' or '10.0.0.5:8786' ({e})"
            ) from None
        return
    raise TypeError(
        f"client must be a distributed.Client, a Dask cluster (LocalCluster, dask-cloudprovider ...), "
        f"a scheduler address ('tcp://host:8786') or None for the embedded LocalCluster; got {type(client).__name__}"
    )


#: What :func:`check_sync` says to do instead, by default.
SYNC_REMEDY = (
    "pass a synchronous Client (Client(address)), or call vcdask in a thread: "
    "await asyncio.to_thread(vcdask.fit, model, data, client=client) (likewise vcdask.resume and vcdask.attach)"
)


def check_sync(client: Any, remedy: str = SYNC_REMEDY) -> None:
    """Refuse a client (or cluster) that is asynchronous here: ``Client(asynchronous=True)`` used from its
    event loop, where each of its calls returns a coroutine to await, and vcdask's calls, which block, would
    read that coroutine as the answer.

    From another thread the same client answers synchronously (distributed's ``Client.asynchronous`` is
    False there): ``await asyncio.to_thread(vcdask.fit, ...)`` trains with it.

    Raises
    ------
    TypeError
        ``client`` is asynchronous in the calling thread (``remedy`` says what to do instead).
    """
    if getattr(client, "asynchronous", False):
        what = " ".join(str(part) for part in (type(client).__name__, getattr(client, "id", None)) if part)
        raise TypeError(
            f"{what} is asynchronous here (asynchronous=True, used from its event loop: its calls return "
            f"coroutines), and vcdask's calls block: {remedy}"
        )


def embedded_client():
    """The process's embedded client: started on first use, then shared by every later
    :func:`vcdask.fit` / :func:`vcdask.resume` without ``client=``, and closed when the interpreter exits.

    It is started again when it was closed (:func:`close_embedded`) or has no worker left, the way
    :func:`distributed.default_client` gives one client per process.  It is never made the default
    client (``set_as_default=False``): your own ``Client`` stays the default.

    Returns
    -------
    distributed.Client

    Raises
    ------
    MainGuardError
        Called from the top level of a script without ``if __name__ == "__main__":`` (the worker
        processes would run the script again; see :func:`check_main_guard`).
    """
    from distributed import Client

    with _lock:
        client, cluster = _embedded.get("client"), _embedded.get("cluster")
        if client is not None and _alive(client, cluster):
            return client
        live = live_runs(cluster) if client is not None and client.status == "running" else []
        if live:  # its workers are gone, but runs wait for them: never replace a cluster under a run
            logger.warning(
                "the embedded cluster has no worker, but runs %s still live on it: keeping it (the runs wait "
                "for workers to come back; vcdask.close_embedded() closes it)",
                live,
            )
            return client
        if client is not None:
            logger.info("the embedded cluster was closed or lost its workers: starting a new one")
            _close(client, cluster)
        check_main_guard(stacklevel=3)
        cluster = embedded_cluster()
        try:
            client = Client(cluster, set_as_default=False)
        except BaseException:  # (Ctrl-C while it connects: no cluster of this process left running)
            _close(cluster)
            raise
        logger.info("started an embedded LocalCluster: %s", cluster.dashboard_link)
        if not _embedded.get("atexit"):
            atexit.register(_close_at_exit)
            _embedded["atexit"] = True
        _embedded.update(client=client, cluster=cluster)
        return client


def running_embedded_client():
    """The embedded client, when this process started it and it is open; else None (never starts one:
    :func:`vcdask.attach` without ``client=`` asks it first, where ``fit`` and ``resume`` run)."""
    client = _embedded.get("client")
    return client if client is not None and client.status == "running" else None


def is_embedded(client: Any) -> bool:
    """Whether ``client`` is the process's embedded client (its runs end when it is closed, see
    :func:`close_embedded`)."""
    return client is not None and client is _embedded.get("client")


#: How long a running embedded cluster without workers is given for its nannies to bring one back.
REVIVE_SECONDS = 10.0


def _alive(client, cluster) -> bool:
    """Whether the embedded cluster can take a run: open, with a worker (or one back within
    :data:`REVIVE_SECONDS`: a nanny restarts a worker process that died)."""
    try:
        if client.status != "running" or cluster.status.name != "running":
            return False
        if not cluster.scheduler.workers:  # the scheduler runs in this process
            client.wait_for_workers(1, timeout=REVIVE_SECONDS)
        return True
    except Exception:  # noqa: BLE001 - anything odd about a half-closed cluster means: start anew
        return False


def live_runs(cluster: Any) -> list[str]:
    """The vcdask runs still going on an embedded cluster (its scheduler lives in this process)."""
    try:
        plugin = cluster.scheduler.plugins.get("vcdask")
        return [] if plugin is None else plugin.live_runs()
    except Exception:  # noqa: BLE001 - a cluster half-closed has no run to keep
        return []


def _close(*things: Any) -> None:
    """Close a client and its cluster, logging what fails (the caller's own error, if any, is what it raises)."""
    for thing in things:
        try:
            thing.close()
        except Exception:
            logger.debug("closing the embedded %s", type(thing).__name__, exc_info=True)


def close_embedded() -> None:
    """Close the process's embedded cluster now (it is closed at interpreter exit anyway); the next
    :func:`vcdask.fit` without ``client=`` starts a new one.

    Runs still going on it (``fit(wait=False)``) end with it where they are, not over: a warning names them,
    ``vcdask runs`` lists them as ``incomplete (shut down)``, and :func:`vcdask.resume` continues them
    from their last commit."""
    with _lock:
        client, cluster = _embedded.pop("client", None), _embedded.pop("cluster", None)
    if client is None:
        return
    live = live_runs(cluster)
    if live:
        import warnings

        warnings.warn(
            f"close_embedded(): runs {live} are still going on the embedded cluster; closing it ends them where "
            "they are (their stores keep what they committed; vcdask.resume(run_id) continues them)",
            RuntimeWarning,
            stacklevel=2,
        )
    _close(client, cluster)


def _close_at_exit() -> None:
    """:func:`close_embedded` when the interpreter exits, without the cluster's closing chatter: by then
    the streams its log handlers write to may be closed (pytest's captures), and each message would
    print a "Logging error" traceback."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        close_embedded()
    finally:
        logging.disable(previous)


def in_task() -> bool:
    """Whether this code runs inside a Dask task (``distributed.get_worker()`` finds the worker running it)."""
    from distributed import get_worker

    try:
        get_worker()
    except ValueError:  # ("No worker found")
        return False
    return True


@contextlib.contextmanager
def resolve_client(client: Any, *, keep: bool = False) -> Iterator[Any]:
    """Yield a Client: the given one (left open), one for a given cluster or address (cluster left
    running; the client closed on exit, and on an exception even with ``keep``: with ``keep`` the
    caller owns it, see :func:`owns_client`), or without one, inside a Dask task the task's own
    cluster's (:func:`distributed.worker_client`: the task's thread leaves the worker's pool while the
    run goes on, and its worker trains too), else the process's shared embedded client
    (:func:`embedded_client`, left running)."""
    from distributed import Client, worker_client

    check_client(client)
    if isinstance(client, Client):
        yield client
    elif client is not None:
        c = Client(client, set_as_default=False)
        try:
            yield c
        except BaseException:
            c.close()
            raise
        if not keep:
            c.close()
    elif in_task():  # (a worker process cannot start the embedded cluster's: daemonic processes have no children)
        with worker_client() as c:
            yield c
    else:
        yield embedded_client()


def owns_client(client: Any) -> bool:
    """Whether :func:`resolve_client` opens a Client of its own for ``client`` (a cluster object or an
    address), which whoever keeps it must close."""
    from distributed import Client

    return client is not None and not isinstance(client, Client)
