"""An unpickled store opens at its first use, not while it is unpickled: a run's spec names the store it was
written to without opening it, and a Dask worker that cannot open a task's store fails the task with the store's
error (it failed to deserialize the task's message instead, and lost its connection to the scheduler for good:
the run failed minutes later with a NoWorkersError)."""

from __future__ import annotations

import os
import pickle
import time

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import vcdask
from vcdask.errors import RunFailedError, StoreAccessDeniedError, StoreCredentialsError, StoreNotFoundError

#: A worker's environment with no AWS credentials and nowhere else to look for them (the environment a worker
#: process is forked with may hold the test process's: these replace them).
NO_AWS_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "",
    "AWS_SECRET_ACCESS_KEY": "",
    "AWS_SESSION_TOKEN": "",
    "AWS_PROFILE": "",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


def test_a_store_unpickled_where_it_is_gone_opens_nothing_until_used_and_then_says_so(tmp_path):
    """Unpickling a store reads nothing (a spec names the store it was written to; a worker unpickles a task's
    store while Dask deserializes the task's message): it opens at its first use, and says there why not."""
    store = vcdask.open_store(tmp_path / "s")
    v = store.commit({"w": torch.ones(2)})
    blob = pickle.dumps(store)
    os.rename(tmp_path / "s", tmp_path / "t")
    copy = pickle.loads(blob)
    assert copy.location == store.location and copy.mode == "r+"
    assert isinstance(copy, vcdask.store.ParamStore)
    assert pickle.loads(pickle.dumps(copy)) is copy  # (pickles as it came: one store per location a process)
    with pytest.raises(StoreNotFoundError, match="no vcdask store"):
        copy.head()
    assert not (tmp_path / "s").exists()
    os.rename(tmp_path / "t", tmp_path / "s")  # back: the next use opens it, and it is that store from then on
    assert copy.head() == v and type(copy) is type(store) and copy.read().version == v


@pytest.mark.cluster
@pytest.mark.s3
def test_a_worker_that_cannot_open_a_tasks_store_fails_the_task_and_keeps_its_connection(s3):
    """An S3 store whose credentials are in the client's environment only (the store holds no secret)."""
    store = vcdask.open_store(f"s3://{s3.new_bucket()}/params", endpoint_url=s3.endpoint_url)
    v = store.commit({"w": torch.ones(2)})
    assert not store.holds_secrets
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0", env=NO_AWS_CREDENTIALS
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        [worker] = client.scheduler_info()["workers"]
        with pytest.raises(StoreAccessDeniedError, match="no credentials"):
            client.submit(lambda s: s.head(), store, pure=False).result(timeout=60)
        assert client.run(os.getpid, workers=[worker]).keys() == {worker}  # still connected
        assert client.submit(lambda s: s.location, store, pure=False).result(timeout=60) == store.location
        # a run: refused before it starts, or failed by its tasks naming the store's error (not a NoWorkersError
        # once the worker that lost its connection was given up, 300 s later)
        X = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
        t0 = time.monotonic()
        with pytest.raises((RunFailedError, StoreCredentialsError), match="no credentials"):
            vcdask.fit(torch.nn.Linear(3, 1), (X, X[:, :1]), store=store, client=client, max_epochs=1, progress=False)
        assert time.monotonic() - t0 < 200
    assert store.head() == v
