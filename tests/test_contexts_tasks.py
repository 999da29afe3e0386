"""vcdask inside a Dask task: ``fit`` without ``client=`` runs on the cluster the task runs on (as
``distributed.get_client()`` would), its thread seceded while the run goes on; ``attach`` finds the run there."""

from __future__ import annotations

import numpy as np
import torch
from distributed import Client, LocalCluster, get_client, get_worker, rejoin, secede

import vcdask


def _data(n=160):
    X = np.random.default_rng(0).normal(size=(n, 4)).astype("float32")
    return X, (X[:, 0] > 0).astype("int64")


def _train_in_a_task(store: str, wait: bool) -> dict:
    torch.manual_seed(0)
    run = vcdask.fit(torch.nn.Linear(4, 2), _data(), max_epochs=2, n_shards=4, store=store, progress=False, wait=wait)
    if wait:
        result = run
    else:  # the handle's client is the task's; waiting on it, the task leaves its worker's pool as Dask says to
        assert run.client is get_client()
        secede()
        result = vcdask.attach(run.run_id).result()  # (attach without a client: the task's cluster)
        rejoin()
    return {
        "merged": int(result.history["accepted"].sum()),
        "workers": sorted(set(result.history["worker"].dropna())),
        "scheduler": get_worker().scheduler.address,
    }


def test_fit_without_a_client_in_a_dask_task_trains_on_the_tasks_cluster(client, tmp_path):
    """It started an embedded cluster in the worker process, whose nannies failed to start (daemonic processes
    are not allowed to have children): "Nanny failed to start"."""
    workers = sorted(client.scheduler_info()["workers"])
    for wait in (True, False):
        seen = client.submit(_train_in_a_task, str(tmp_path / f"s{wait}"), wait, pure=False).result(timeout=120)
        assert seen["merged"] == 8  # 2 epochs of 4 shards
        assert seen["scheduler"] == client.scheduler.address
        # both workers trained: the task's own thread left its worker's pool (secede) while it waited for the run
        assert seen["workers"] == workers, seen


def _attach_in_a_task(run_id: str) -> str:
    return vcdask.attach(run_id).result().version


def test_attach_without_a_client_in_a_dask_task_finds_the_run_on_the_tasks_cluster(tmp_path):
    """It asked the embedded cluster and the default client only: "no vcdask run ... here"."""
    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        torch.manual_seed(0)
        result = vcdask.fit(
            torch.nn.Linear(4, 2), _data(), max_epochs=1, n_shards=2, client=client, store=tmp_path / "s",
            progress=False,
        )  # fmt: skip
        assert client.submit(_attach_in_a_task, result.run_id, pure=False).result(timeout=60) == result.version
