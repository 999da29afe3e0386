"""A worker process SIGKILLed mid-run: the run completes, every shard of every epoch merged exactly once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from chaos_helpers import worker_info
from distributed import Client

import vcdask
from vcdask.cluster import embedded_cluster

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def _kill_busy_worker(client: Client, timeout: float = 60) -> str:
    """SIGKILL a worker process while it is training a shard; return its address."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for addr, keys in client.processing().items():
            if any(str(k).startswith("vcdask-train-") for k in keys):
                pid = client.run(os.getpid, workers=[addr])[addr]
                os.kill(pid, signal.SIGKILL)
                return addr
        time.sleep(0.02)
    raise TimeoutError("no worker was training")


def test_worker_sigkill_mid_run(digits_data, tmp_path):
    (X, y), _ = digits_data
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    with embedded_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as client:
        out = {}

        def run():
            try:
                out["result"] = vcdask.fit(
                    model,
                    (X, y),
                    validation=0.1,
                    max_epochs=4,
                    n_shards=6,
                    local_epochs=8,
                    alpha=0.5,
                    client=client,
                    store=tmp_path / "s",
                    progress=False,
                    retention=False,  # every version stays: the merges are read back from them
                )
            except BaseException as e:  # noqa: BLE001 - re-raised below
                out["error"] = e

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(1.0)
        killed = _kill_busy_worker(client)
        thread.join(300)
        assert "error" not in out, out.get("error")
        result = out["result"]
        assert killed not in worker_info(client)  # it really died (the nanny started a new one)
    h = result.history
    accepted = h[h.accepted]
    assert len(accepted) == 4 * 6
    assert not accepted.duplicated(["epoch", "shard"]).any()
    assert sorted(map(tuple, accepted[["epoch", "shard"]].values.tolist())) == [
        (e, s) for e in range(1, 5) for s in range(6)
    ]
    assert accepted.new_version.tolist() == list(range(1, 25))
    versions = result.store.versions(result.run_id)
    merged = [tuple(m[:2]) for v in versions for m in v.metadata["merged"]]
    assert sorted(merged) == sorted(map(tuple, accepted[["epoch", "shard"]].values.tolist()))
    assert result.metrics["accuracy"] > 0.7  # trained: chance is 0.1
