"""A healthy run on a fresh cluster rejects no update as stale (issue 10: cold workers' first tasks)."""

from __future__ import annotations

import dask.config
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
    (max_staleness=16)"; later, with the cold cost of PyTorch's first optimizer (it imports
    ``torch._dynamo``: 2-3.7 s) still paid after the base was chosen, 1 run in 4 rejected one 14-18
    merges old, and each worker's first update was typically 5 merges old (0-1 once it is paid before)."""
    from distributed import Client
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = ((X - X.mean(0)) / X.std(0)).astype("float32")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    with (
        dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}),  # cold: not forked (conftest.py)
        embedded_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
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
    firsts = h.groupby("worker").head(1)  # each worker's first task (rows in the order the run decided them)
    assert len(firsts) == 2
    # its warm-up is paid before it asks for its base (read 2-3 s, then train 10-20 ms; before: read
    # 0.2-0.4 s, train 2-3.7 s), so it is not charged as staleness
    assert (firsts.train_seconds < firsts.read_seconds).all(), firsts[["read_seconds", "train_seconds"]]
    assert firsts.staleness.max() <= 4, firsts.staleness
    assert h[h.accepted].staleness.max() <= staleness_limit("auto", n_shards=6, in_flight=4)
