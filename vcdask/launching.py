"""The cluster a run starts on, and what it must offer before the run's data is staged there.

:func:`run_client` picks the Client (the one :func:`~vcdask.options.plan` connected to, or
:func:`~vcdask.cluster.resolve_client`'s), :func:`check_cluster` checks its processes (vcdask and PyTorch
installed, the store readable with their own credentials, a worker with the run's device), :func:`discard_run`
deletes what a launch wrote when the run never started, and :func:`wait_for` waits for a run started.  Used
by :func:`vcdask.runs.launch` and :func:`vcdask.resume`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ._packages import check_packages
from .cluster import resolve_client
from .errors import DeviceUnavailableError
from .store import ParamStore, check_cluster_access, share_credentials, store_holds_secrets

if TYPE_CHECKING:
    from .handle import RunHandle
    from .options import RunPlan

logger = logging.getLogger("vcdask")


@contextlib.contextmanager
def run_client(plan: RunPlan, client: Any, *, keep: bool) -> Iterator[Any]:
    """The Client a run starts on: the one :func:`~vcdask.options.plan` connected to ``client`` (a cluster object
    or an address) to compute on the run's dask data there, owned as :func:`~vcdask.cluster.resolve_client` owns
    one it opens (closed on an error, and on exit unless ``keep``: then the handle owns it); else
    :func:`~vcdask.cluster.resolve_client`'s."""
    if plan.client is None:
        with resolve_client(client, keep=keep) as c:
            yield c
        return
    started = False
    try:
        yield plan.client
        started = True
    finally:
        if not started or not keep:
            plan.client.close()


def discard_run(store: ParamStore, run_id: str) -> None:
    """Delete what staging wrote for a run that never started: its branch (its initial version) and its
    folder (the staged data).  What cannot be deleted is logged: the launch's own error is what the caller
    hears of."""
    try:
        repo = getattr(store, "_repo", None)  # (an Icechunk store's repository: no ParamStore method deletes a branch)
        if repo is not None and run_id in repo.list_branches():
            repo.delete_branch(run_id)
        files = store.files
        with contextlib.suppress(FileNotFoundError):
            files.fs.rm(f"{files.root}/{run_id}", recursive=True)
    except Exception:
        logger.warning(
            "run %s did not start; could not delete its branch and folder in %s", run_id, store.location, exc_info=True
        )


def check_cluster(c, store: ParamStore, *, embedded: bool, device: str = "auto") -> None:
    """What the cluster must offer before a run starts: a scheduler and workers with vcdask and PyTorch
    (:func:`~vcdask._packages.check_packages`; the embedded cluster's run this interpreter), that can open the
    store.

    ``embedded``: ``c`` is the process's embedded cluster (our own processes on this machine, started from
    this interpreter with its environment).  A store opened here with explicit credentials pickles without
    them: the embedded cluster is given them with :func:`~vcdask.store.share_credentials`.  Any other
    cluster (the caller's; a Dask task's own, for a run started inside a task) must open the store with what
    its processes have, and :func:`~vcdask.store.check_cluster_access` checks that every one of them can,
    naming the remedies, before the run starts: its workers might have no credentials for the store, or not
    see the local directory it is in (another machine), and would otherwise fail every task of the run.
    ``device``: the run's (:func:`check_devices`).
    """
    if not embedded:
        check_packages(c)
    check_devices(c, device)
    if not store.shared_across_processes:
        pids = set(c.run(os.getpid).values())
        if pids != {os.getpid()}:
            raise ValueError(
                f"store {store.location!r} lives in this process only, but the workers "
                "run in other processes; use a directory or object-store location"
            )
        return
    if embedded and store_holds_secrets(store):
        share_credentials(c, store)
    if not embedded or store_holds_secrets(store):
        check_cluster_access(store, c)


def check_devices(c, device: str) -> None:
    """Refuse a run on a device none of the cluster's workers has (``device="cuda"`` on CPU machines: the run
    would exclude each worker at its first task, then wait ``no_worker_timeout`` for one that has it); warn of
    the workers without it, each excluded at its first task (a mixed fleet).  Each worker has
    :data:`~vcdask._packages.PROBE_SECONDS` to answer (one that does not is not known to lack it).  ``"auto"``
    and ``"cpu"`` run anywhere.

    Raises
    ------
    DeviceUnavailableError
        No worker has the device (each one's answer named).
    """
    if device in ("auto", "cpu"):
        return
    from ._packages import PROBE_SECONDS, ask_workers

    asked = ask_workers(c, PROBE_SECONDS, fn=_lacks_device, args=(device,))
    answers = {w: why for w, why in asked.items() if why is None or isinstance(why, str)}  # (the rest: unknown)
    lacking = {w: why for w, why in answers.items() if why is not None}
    if answers and len(lacking) == len(asked):
        first = next(iter(lacking.values()))
        raise DeviceUnavailableError(
            f"device={device!r}, but none of the cluster's {len(answers)} workers has it (e.g. {first}): start "
            "workers on machines that have it, or use device='auto' (each worker trains on what it has)"
        )
    if lacking:
        logger.warning(
            "device=%r: %d of %d workers do not have it; each is excluded from the run at its first task: %s",
            device,
            len(lacking),
            len(answers),
            ", ".join(sorted(lacking)),
        )


def _lacks_device(device: str) -> str | None:
    """Why this worker cannot train on ``device`` (None: it can)."""
    from .device import resolve_device

    try:
        resolve_device(device)
    except DeviceUnavailableError as e:
        return str(e)
    return None


def wait_for(handle: RunHandle, progress: bool) -> None:
    """Wait for the run of ``fit`` or ``resume`` (``wait=True``); interrupted (Ctrl-C: the run was stopped), the
    handle nobody else holds lets go of the run, so that the scheduler may drop it once it ended, as it drops
    collected ones (:meth:`~vcdask.RunHandle.close`; ``vcdask.attach`` still finds it meanwhile)."""
    try:
        handle.wait(progress=progress)
    except BaseException:
        handle.close()
        raise


def let_go_of_rows(plan: RunPlan) -> None:
    """Drop the plan's arrays once staged (the workers read the store's copy): ``fit`` held the seeded shuffle's
    copy of the caller's rows for the whole run (1 GiB of rows: 2.6 GB resident in its process, not 1.6)."""
    for part in (plan.train, plan.validation):
        if part is not None:  # (its few rows for the checks stay: sample_X, sample_y)
            part.X = part.y = part.columns = part.order = None
