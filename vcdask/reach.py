"""Reaching a run where it lives: :func:`attach`, the run id a caller names (a result or handle taken for
its id), and, for :func:`vcdask.resume`, whether the run still goes on at another scheduler.

Also the store a resume continues a run in (:func:`run_store`).

A run lives on the scheduler that drives it; its record in the store (``runs/<id>/status.json``) names that
scheduler's address while it runs.  A resume on another scheduler asks that one first: two drivers on one
branch would reuse each other's attempt numbers and update paths, delete each other's uploads and lose commits.
"""

from __future__ import annotations

import asyncio
import pickle
import secrets
from typing import Any

from .errors import RunLiveElsewhereError, RunNotFoundError, StoreNotFoundError, VersionNotFoundError
from .handle import RunHandle, _has_plugin
from .options import DEFAULT_STORE
from .result import FitResult
from .spec import spec_path
from .store import ParamStore, open_store

__all__ = ["ASK_TIMEOUT", "attach", "check_not_live_elsewhere", "run_id_of", "run_store"]

#: What an asynchronous client used from its event loop is told to do instead.
ATTACH_REMEDY = (
    "pass a synchronous Client (Client(address)), or attach in a thread: "
    "await asyncio.to_thread(vcdask.attach, run_id, client)"
)

#: How long a resume waits for the scheduler its run's record names to answer (seconds): one that is gone
#: (its machine reclaimed, its process killed) does not hold the resume up longer.
ASK_TIMEOUT = 3.0


def run_id_of(run: Any, caller: str) -> str:
    """The id of the run ``run`` names: a run id, or the ``run_id`` of a :class:`~vcdask.FitResult` or
    :class:`~vcdask.RunHandle`.

    Raises
    ------
    TypeError
        Anything else (``caller`` names the function it was passed to).
    """
    if isinstance(run, str):
        return run
    if isinstance(run, (FitResult, RunHandle)):
        return run.run_id
    raise TypeError(
        f"{caller}() takes a run's id (a str such as 'run-20261124-020000-84c1d2'), got a {type(run).__name__}: "
        "pass result.run_id"
    )


def attach(run_id: str | FitResult | RunHandle, client: Any = None) -> RunHandle:
    """A handle on a run that lives on a scheduler, from any process that can reach it.

    Parameters
    ----------
    run_id : str, FitResult or RunHandle
        The run's id (``FitResult.run_id``, or the progress bar's label); a result or handle stands for its own.
    client : distributed.Client, cluster or str, optional
        A client, a cluster object or a scheduler address.  Default: the process's embedded cluster, where
        ``fit`` and ``resume`` without ``client=`` run (when it is up), then inside a Dask task the task's
        own cluster (where they run there), then the current default client.

    Raises
    ------
    RunNotFoundError
        No such run on the scheduler, or one it dropped (``vcdask.scheduler.ended-runs-kept``); the message says.
        Without ``client``: no cluster of this process has it (the message names the ones asked).
    TypeError
        ``run_id`` is neither a str nor a result or handle; ``client`` is not one of the above, or is an
        asynchronous client used from its event loop (the default client too, without ``client``): call
        ``await asyncio.to_thread(vcdask.attach, run_id, client)`` there.
    """
    from distributed import Client

    from .cluster import check_client, check_sync

    run_id = run_id_of(run_id, "attach")
    check_sync(client, ATTACH_REMEDY)
    check_client(client)
    if client is None:
        return _attach_here(run_id)
    if not isinstance(client, Client):
        client = Client(client, set_as_default=False)
        try:
            return _attach(run_id, client, owns_client=True)
        except BaseException:
            client.close()
            raise
    return _attach(run_id, client)


def _attach_here(run_id: str) -> RunHandle:
    """:func:`attach` without a client: the embedded cluster's run, else (in a Dask task) the task's cluster's,
    else the default client's."""
    from distributed import default_client, get_client

    from .cluster import in_task, running_embedded_client

    candidates = [running_embedded_client()]
    if in_task():  # (where fit and resume without a client run there)
        candidates.append(get_client())
    try:
        candidates.append(default_client())
    except ValueError:  # ("No clients found")
        pass
    missing = []
    for client in dict.fromkeys(c for c in candidates if c is not None):
        try:
            return _attach(run_id, client)
        except RunNotFoundError as e:
            missing.append(str(e))
    said = "; ".join(missing) if missing else "this process has no embedded cluster up and no default Dask client"
    raise RunNotFoundError(
        f"no vcdask run {run_id!r} here ({said}); pass the scheduler it runs on: "
        "vcdask.attach(run_id, client_or_address)"
    )


def _attach(run_id: str, client: Any, owns_client: bool = False) -> RunHandle:
    from .cluster import check_sync

    check_sync(client, ATTACH_REMEDY)  # (an asynchronous default client: its answers are coroutines)
    if not client.run_on_scheduler(_has_plugin):
        raise RunNotFoundError(
            f"no vcdask run {run_id!r}: the scheduler at {client.scheduler.address} has never run vcdask"
        )
    missing = client.sync(client.scheduler.vcdask_missing, run_id=run_id)
    if missing is not None:
        raise RunNotFoundError(missing)
    holder = secrets.token_hex(8)  # (the run is kept while this handle holds it)
    client.sync(client.scheduler.vcdask_hold, run_id=run_id, holder=holder)
    return RunHandle(run_id, client, owns_client=owns_client, holder=holder)


def check_not_live_elsewhere(record: dict[str, Any] | None, run_id: str, client: Any) -> None:
    """Refuse to resume a run that still goes on at another scheduler than ``client``'s.

    ``record`` is the run's record (:func:`vcdask.engine.end.read_record`); while it says ``running`` it names
    the scheduler that drives the run.  That scheduler is asked (for at most :data:`ASK_TIMEOUT` seconds)
    whether the run is live there; one that does not answer, or has not the run going, is not in the way (its
    scheduler died: what a resume is for).  The run's own scheduler is not asked: it answers the resume itself.

    Raises
    ------
    RunLiveElsewhereError
        The run goes on at the scheduler its record names (the message names it, and how to follow the run).
    """
    where = (record or {}).get("scheduler")
    if (record or {}).get("status") != "running" or not isinstance(where, str) or not where:
        return
    if where in (client.scheduler.address, client.scheduler_info().get("address")):
        return
    status = client.sync(_status_at, where, run_id, client.connection_args)
    if status is not None and status not in ("finished", "error", "cancelled"):
        raise RunLiveElsewhereError(
            f"run {run_id!r} is still {status} on the scheduler at {where}: resuming it on "
            f"{client.scheduler.address} would drive it twice (both writing its branch); follow it with "
            f"vcdask.attach({run_id!r}, {where!r}), or stop it there first (handle.stop()) and resume it then"
        )


async def _status_at(address: str, run_id: str, connection_args: dict[str, Any]) -> str | None:
    """The run's status at the scheduler at ``address``, or None: unreachable within :data:`ASK_TIMEOUT`
    seconds, no vcdask there, or no such run."""
    from distributed.core import rpc

    try:
        async with rpc(address, timeout=ASK_TIMEOUT, connection_args=connection_args) as scheduler:
            status = await asyncio.wait_for(scheduler.vcdask_status(run_id=run_id), ASK_TIMEOUT)
    except Exception:  # noqa: BLE001 - gone, no vcdask, no such run: nothing drives the run there
        return None
    return status.get("status") if isinstance(status, dict) else None


def run_store(run: Any, run_id: str, store: Any) -> ParamStore:
    """The store that :func:`resume` continues ``run_id`` in (``run``: as given to it): ``store`` when given,
    over a result's own; else the run's own (:func:`_own_store`); else ``./vcdask-runs``.

    Raises
    ------
    VersionNotFoundError
        The store has no run ``run_id`` (the runs it has listed); a handle that does not hold its store is
        told to pass ``store=``, also where ``./vcdask-runs`` does not exist.
    """
    own = _own_store(run) if store is None else None
    unknown = store is None and own is None and isinstance(run, RunHandle)
    hint = (
        f"; this handle of run {run_id} does not hold its run's store (it does once it has collected the run's "
        "result, handle.result(), or cancelled it): pass store=, the store fit was given"
        if unknown
        else ""
    )
    try:
        param_store = open_store(store if store is not None else own if own is not None else DEFAULT_STORE, mode="r+")
    except StoreNotFoundError as e:
        if not unknown:
            raise
        raise VersionNotFoundError(f"{e}{hint}") from None
    if run_id not in param_store.branches() or not param_store.files.exists(spec_path(run_id)):
        runs = sorted(b for b in param_store.branches() if param_store.files.exists(spec_path(b)))
        raise VersionNotFoundError(f"no run {run_id!r} in {param_store.location!r}; runs: {runs}{hint}")
    return param_store


def _own_store(run: Any) -> ParamStore | None:
    """The store a result or a handle of a run names: a :class:`FitResult`'s own; a :class:`RunHandle`'s once
    it holds the run's result (collected, or the run cancelled through it: the store comes pickled in it, as
    ``handle.result()`` reads it); None otherwise (a run id, a handle that knows only the id)."""
    if isinstance(run, FitResult):
        return run.store
    res = run._res if isinstance(run, RunHandle) else None  # (RunHandle keeps no store of its own before that)
    return None if res is None else pickle.loads(res["store"])
