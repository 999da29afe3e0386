"""vcdask.resume(result) without store= opened ./vcdask-runs (StoreNotFoundError, or VersionNotFoundError where
./vcdask-runs exists), though "a result or handle of the run stands for its own": a result's own store is used, a
handle's once it holds its run's result; a handle that knows only the run's id is told to pass store=."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vcdask
from vcdask.errors import VersionNotFoundError
from vcdask.store import open_store


def test_resume_of_a_result_or_a_handle_continues_in_the_runs_own_store(tmp_path, monkeypatch):
    from distributed import Client, LocalCluster

    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 4)).astype("float32")
    y = (X[:, 0] > 0).astype("int64")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    kw = dict(progress=False)
    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        where = tmp_path / "runs"
        result = vcdask.fit(torch.nn.Linear(4, 2), (X, y), max_epochs=1, n_shards=2, store=where, client=client, **kw)
        monkeypatch.chdir(elsewhere)  # no ./vcdask-runs here
        more = vcdask.resume(result, client=client, max_epochs=2, **kw)
        assert more.run_id == result.run_id and list(more.epochs.index) == [1, 2]
        assert more.store.location == result.store.location

        open_store(elsewhere / "vcdask-runs")  # a ./vcdask-runs without the run
        again = vcdask.resume(more, client=client, max_epochs=3, **kw)
        assert list(again.epochs.index) == [1, 2, 3]
        # a store= given is the one searched, over the result's own
        open_store(tmp_path / "other")
        with pytest.raises(VersionNotFoundError, match=r"no run .* in .*other"):
            vcdask.resume(again, store=tmp_path / "other", client=client, max_epochs=4, **kw)

        # a handle holds its run's store once it cancelled the run (or collected its result) ...
        model = torch.nn.Linear(4, 2)
        handle = vcdask.fit(model, (X, y), max_epochs=50, n_shards=2, store=where, client=client, wait=False, **kw)
        handle.cancel()
        resumed = vcdask.resume(handle, client=client, max_epochs=1, **kw)
        assert resumed.run_id == handle.run_id and resumed.store.location == result.store.location
        # ... before, it knows only the run's id: store= is asked for
        only_id = vcdask.attach(result.run_id, client)
        with pytest.raises(VersionNotFoundError, match=r"does not hold its run's store .* pass store="):
            vcdask.resume(only_id, client=client, max_epochs=5, **kw)
        assert len(vcdask.resume(only_id, store=tmp_path / "runs", client=client, max_epochs=4, **kw).epochs) == 4
