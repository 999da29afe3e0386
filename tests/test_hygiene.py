"""What a notebook's afternoon of fits leaves behind: closed clusters, ended runs and resumed sessions let go of
their threads, data and event topics (a long-lived scheduler, or the notebook's own embedded one)."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import vcdask
from vcdask.engine.end import LetGo
from vcdask.engine.plugin import PLUGIN_NAME

pytestmark = pytest.mark.cluster


def _data(n=256):
    X = np.random.default_rng(0).normal(size=(n, 4)).astype("float32")
    return X, (X[:, 0] > 0).astype("int64")


def _local():
    return LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0", silence_logs=logging.ERROR
    )


def _loop_threads() -> int:
    return sum(t.name == "IO loop" for t in threading.enumerate())


def test_a_closed_cluster_whose_scheduler_ran_a_fit_leaves_no_event_loop_thread(tmp_path):
    """The run's own client on the scheduler (asynchronous) never gave back its count on the cluster's loop
    runner: each cluster closed after a fit kept its "IO loop" thread, sockets and objects."""
    before = _loop_threads()
    for i in range(2):
        with _local() as cluster, Client(cluster, set_as_default=False) as client:
            vcdask.fit(torch.nn.Linear(4, 2), _data(), max_epochs=1, store=tmp_path / f"s{i}", client=client,
                       progress=False)  # fmt: skip
    deadline = time.monotonic() + 10
    while _loop_threads() > before:
        assert time.monotonic() < deadline, f"{_loop_threads() - before} loop threads left"
        time.sleep(0.1)


def test_an_ended_run_on_the_scheduler_lets_go_of_its_data(tmp_path):
    """An ended run kept its spec's data sources: a map-style Dataset is the whole dataset, and the embedded
    scheduler is the notebook's own process (every ended run's dataset stayed, up to ``ended-runs-kept``)."""
    X, y = _data()
    dataset = torch.utils.data.TensorDataset(torch.as_tensor(X), torch.as_tensor(y))
    with _local() as cluster, Client(cluster, set_as_default=False) as client:
        result = vcdask.fit(torch.nn.Linear(4, 2), dataset, max_epochs=1, validation=0.25, store=tmp_path / "s",
                            client=client, progress=False)  # fmt: skip
        plugin = cluster.scheduler.plugins[PLUGIN_NAME]
        run = plugin.runs[result.run_id]
        assert run.spec.train == LetGo(192) and run.spec.validation == LetGo(64) and run.spec.model is None
        # (the probe kept for a rule the run might grow into holds the spec too: the model and the dataset)
        assert run.server.probe is None and run.server.spare_probe is None
        assert client.sync(client.scheduler.vcdask_status, run_id=result.run_id)["status"] == "finished"
    # a closed scheduler keeps this plugin (distributed keeps its handlers for the process's life): not its runs
    assert plugin.runs == {} and plugin.tasks == {}


def _run_client_topics(dask_scheduler, run_id):
    return sorted(
        n for n in dask_scheduler._broker._topics if isinstance(n, str) and n.startswith(f"Client-vcdask-{run_id}")
    )


def test_a_run_resumed_again_and_again_keeps_no_topic_of_its_sessions_clients(tmp_path):
    """Each session of a resumed run left its client's event topic on the scheduler for good (16-22 events
    each): a scheduled job resuming one run on a long-lived scheduler grew without bound."""
    with _local() as cluster, Client(cluster, set_as_default=False) as client:
        result = vcdask.fit(torch.nn.Linear(4, 2), _data(), max_epochs=1, store=tmp_path / "s", client=client,
                            progress=False)  # fmt: skip
        for epochs in (2, 3, 4):
            result = vcdask.resume(result.run_id, store=tmp_path / "s", client=client, max_epochs=epochs,
                                   progress=False)  # fmt: skip
        assert client.run_on_scheduler(_run_client_topics, run_id=result.run_id) == []


def test_fit_lets_go_of_its_copy_of_the_rows_once_they_are_staged(tmp_path):
    """The seeded shuffle copies in-memory rows; fit held that copy (and the validation split's) for the whole
    run, beside the caller's own: twice the data in the caller's process while the run trained."""
    from vcdask.options import plan
    from vcdask.runs import launch

    X, y = _data()
    model = torch.nn.Linear(4, 2)
    checked = plan(model, (X, y), validation=0.25, max_epochs=1, store=tmp_path / "s")
    assert checked.train.X is not None and checked.validation.X is not None
    with _local() as cluster, Client(cluster, set_as_default=False) as client:
        handle = launch(checked, client, model, wait=False, progress=False)
        assert checked.train.X is None and checked.train.y is None and checked.validation.X is None
        assert checked.train.sample_X is not None  # (its few rows for the checks)
        assert handle.result().run_id == handle.run_id
