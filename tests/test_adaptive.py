"""``cluster.adapt`` grows a cluster for a run: the scheduler's adaptive target counts the shards the live
runs could train at once (``vcdask.engine.scaling``).  Dask's own counts only the tasks it holds, and a run
queues none there: ``adapt(minimum=1, maximum=3)`` stayed at one worker for a whole 24-shard run."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import vcdask

pytestmark = pytest.mark.cluster


def _data(n=6000, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 8)).astype("float32")
    return X, (X[:, 0] > X[:, 1]).astype("int64")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


def _target(client) -> int:
    return client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.adaptive_target())


def test_an_adaptive_cluster_grows_for_a_run_and_its_target_falls_back_after(tmp_path):
    from distributed import Client

    from vcdask.cluster import embedded_cluster

    with embedded_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
        cluster.adapt(minimum=1, maximum=2, interval="200ms", wait_count=50)
        handle = vcdask.fit(
            _model(), _data(), n_shards=6, max_epochs=3, local_epochs=3, batch_size=16, client=client,
            store=tmp_path / "store", progress=False, wait=False, retention=False,
        )  # fmt: skip
        seen, targets = 1, []
        while not handle.done():
            seen = max(seen, len(client.scheduler_info()["workers"]))
            targets.append(_target(client))
            time.sleep(0.2)
        result = handle.result()
        # the run could use a worker a shard (six, one thread each): Dask's own target said one
        assert max(targets) == 6, targets
        assert seen == 2 and len(result.workers) == 2, (seen, result.workers)
        merged = sorted((e, s) for v in result.store.versions(result.run_id) for e, s, _ in v.metadata["merged"])
        assert merged == [(e, s) for e in (1, 2, 3) for s in range(6)]  # (each once, on the grown cluster)
        assert _target(client) <= 1  # no run: Dask's own again
