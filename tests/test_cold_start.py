"""A healthy run on a fresh cluster rejects no update as stale (issue 10: cold workers' first tasks)."""

from __future__ import annotations

import pytest
import torch

import vcdask
from vcdask.cluster import embedded_cluster
from vcdask.engine.policy import staleness_limit

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_fresh_cluster_rejects_no_update_as_stale(tmp_path):
    """Cold workers (their first task imports torch, reads the spec and its rows) start from the
    newest version once they are ready, so that warm-up is not charged as staleness.  Before, a
    6-shard tabular run rejected a cold worker's first update as "based on a version 17 merges old
    (max_staleness=16)"."""
    from distributed import Client
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = ((X - X.mean(0)) / X.std(0)).astype("float32")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    with embedded_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as client:
        result = vcdask.fit(
            model,
            (X, y),
            n_shards=6,
            max_epochs=4,
            batch_size=16,
            client=client,
            store=tmp_path / "store",
            progress=False,
            validation=0.2,
        )
    h = result.history
    assert len(result.epochs) == 4
    assert not h.outcome.eq("rejected").any(), h[h.outcome == "rejected"][["epoch", "shard", "reason"]]
    assert h.outcome.eq("merged").sum() == 24  # every shard of every epoch, once
    assert h[h.accepted].staleness.max() <= staleness_limit("auto", n_shards=6, in_flight=4)


def _imported(name: str) -> bool:
    import sys

    return name in sys.modules


def _wait_all_imported(client, name: str, n_workers: int, timeout: float = 90) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = client.run(_imported, name)
        if len(seen) == n_workers and all(seen.values()):
            return seen
        time.sleep(0.2)
    raise AssertionError(f"{name} not imported on every worker within {timeout} s: {seen}")


def test_workers_import_torch_before_their_first_task():
    """A cold worker imported torch (1.2 s) when it unpickled its first task and torch._dynamo (1.2 s)
    when that task built its optimizer.  Workers now import both in the background as soon as the
    cluster is known to vcdask (``fit`` registers the plugin) or, for the embedded cluster, as they
    start; a worker that joins later does too."""
    from distributed import Client, LocalCluster

    from vcdask.cluster import warm_workers

    with embedded_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
        _wait_all_imported(client, "torch._dynamo", 1)  # the preload, with no task and no plugin
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        assert not any(client.run(_imported, "torch._dynamo").values())  # a plain worker: not yet
        warm_workers(client)
        warm_workers(client)  # once per cluster: registering again changes nothing
        _wait_all_imported(client, "torch._dynamo", 1)
        cluster.scale(2)
        client.wait_for_workers(2, timeout=60)
        _wait_all_imported(client, "torch._dynamo", 2)  # the worker that joined later
