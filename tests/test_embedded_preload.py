"""The embedded cluster's worker preload (``vcdask._worker_signals``): its workers ignore the process group's
SIGINT and SIGTERM, beside a user's own preloads and their arguments, and nothing else's workers do."""

from __future__ import annotations

import signal

import dask.config
import pytest
from distributed import Client, LocalCluster

from vcdask.cluster import embedded_cluster, start_forkserver

#: A user's preload, given as text as distributed allows.
USER_PRELOAD = "def dask_setup(worker):\n    worker.user_preload_ran = True\n"


def _sigterm(dask_worker) -> tuple[int, bool]:
    return int(signal.getsignal(signal.SIGTERM)), getattr(dask_worker, "user_preload_ran", False)


@pytest.mark.cluster
def test_a_users_preload_with_its_own_arguments_runs_beside_vcdasks():
    """``preload-argv`` as a list per preload: vcdask's preload gets its own (empty) one; the lengths differed,
    distributed refused them, and no worker of the embedded cluster started."""
    config = {"distributed.worker.preload": [USER_PRELOAD], "distributed.worker.preload-argv": [[]]}
    with (
        dask.config.set(config),
        embedded_cluster(n_workers=1) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        [(handler, ran)] = client.run(_sigterm).values()
    assert handler == int(signal.SIG_IGN) and ran


@pytest.mark.cluster
def test_a_users_own_cluster_keeps_sigterm_under_the_fork_server_vcdask_starts():
    """The fork server is shared by the process's clusters: started with SIGTERM ignored, every worker forked
    from it ignored SIGTERM, a user's own LocalCluster's too (and distributed's ``terminate()`` did nothing)."""
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        start_forkserver()
        with (
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
            Client(cluster, set_as_default=False) as client,
        ):
            [(handler, _)] = client.run(_sigterm).values()
    assert handler != int(signal.SIG_IGN)
