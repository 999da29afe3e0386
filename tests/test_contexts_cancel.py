"""RunHandle.cancel() answers as its docstring says: True for a run cancelled (by the call, or already before it),
False for one that had ended otherwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import vcdask
from vcdask.errors import RunCancelledError


def _slow(epoch, step):
    """An lr_schedule whose steps take 20 ms: a run of many epochs goes on until it is cancelled."""
    import time

    time.sleep(0.02)
    return 1.0


def _fit(client, store, **kw):
    X = np.random.default_rng(0).normal(size=(160, 4)).astype("float32")
    torch.manual_seed(0)
    return vcdask.fit(
        torch.nn.Linear(4, 2), (X, (X[:, 0] > 0).astype("int64")), n_shards=2, client=client, store=store,
        progress=False, wait=False, **kw,
    )  # fmt: skip


def test_cancel_is_true_for_a_cancelled_run_again_and_false_for_a_run_that_ended_otherwise(tmp_path):
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        finished = _fit(client, tmp_path / "s", max_epochs=1)
        finished.wait()
        assert finished.cancel() is False  # ended (finished) before: nothing to cancel
        assert finished.result().run_id == finished.run_id and finished.cancel() is False
        going = _fit(client, tmp_path / "s", max_epochs=400, lr_schedule=_slow)
        assert going.cancel() is True
        assert going.cancel() is True  # (already cancelled: True again)
        assert vcdask.attach(going.run_id, client).cancel() is True  # (and from another handle of it)
        with pytest.raises(RunCancelledError):
            going.result()
