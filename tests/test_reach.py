"""Reaching a run where it lives: ``attach`` (a result or handle standing for its id), a handle whose client was
closed, and a resume refused while the run still goes on at another scheduler."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import vcdask
from vcdask.engine.end import read_record
from vcdask.errors import RunLiveElsewhereError, RunNotFoundError
from vcdask.handle import ensure_plugin
from vcdask.reach import ASK_TIMEOUT, check_not_live_elsewhere


def _data(n=160, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 4)).astype("float32")
    return X, (X[:, 0] > 0).astype("int64")


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _slow(epoch, step):
    """An lr_schedule whose steps take 20 ms: a run of many epochs goes on until it is cancelled."""
    import time

    time.sleep(0.02)
    return 1.0


def _long_run(client, store):
    return vcdask.fit(
        _model(), _data(), max_epochs=400, n_shards=2, lr_schedule=_slow, client=client, store=store, wait=False,
        progress=False,
    )  # fmt: skip


def test_a_handle_whose_client_was_closed_says_how_to_reach_its_run(cluster, tmp_path):
    """A handle whose client the user closed raised AttributeError from repr, status, done and result."""
    local, client = cluster
    own = Client(local, set_as_default=False)
    handle = _long_run(own, tmp_path / "s")
    own.close()
    assert repr(handle) == f"<RunHandle {handle.run_id} closed>"
    said = rf"client of this handle .* was closed.*vcdask\.attach\('{handle.run_id}', '{local.scheduler_address}'"
    for ask in (handle.status, handle.done, lambda: handle.result(timeout=1), handle.stop, handle.cancel):
        with pytest.raises(RuntimeError, match=said):
            ask()
    again = vcdask.attach(handle, client)  # (a handle stands for its run's id)
    assert again.run_id == handle.run_id and again.status()["status"] in ("starting", "running")
    assert again.cancel() is True


def test_attach_and_resume_take_a_result_for_its_run_id_and_refuse_other_objects(client, tmp_path):
    store = tmp_path / "s"
    result = vcdask.fit(_model(), _data(), max_epochs=1, n_shards=2, client=client, store=store, progress=False)
    assert vcdask.attach(result, client).result().version == result.version
    for call in (lambda: vcdask.attach(7, client), lambda: vcdask.resume(b"run", store=store, client=client)):
        with pytest.raises(TypeError, match=r"takes a run's id \(a str.*got a (int|bytes): pass result\.run_id"):
            call()
    with pytest.raises(RunNotFoundError, match="no vcdask run 'run-nope'"):
        vcdask.attach("run-nope", client)
    more = vcdask.resume(result, store=store, client=client, max_epochs=2, progress=False)
    assert more.run_id == result.run_id and list(more.epochs.index) == [1, 2]


def test_a_resume_elsewhere_is_refused_while_the_run_goes_on_and_not_once_its_scheduler_closed(client, tmp_path):
    """A resume on scheduler B of a run that still ran on A drove it twice: both reused the run's attempt
    numbers and update paths, one deleted the other's uploads, and one died of a raw StoreConflict."""
    store = tmp_path / "s"
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, protocol="tcp://", dashboard_address=":0"
        ) as other,
        Client(other, set_as_default=False) as there,
    ):
        handle = _long_run(there, store)
        param_store = vcdask.open_store(store, mode="r")
        deadline = time.monotonic() + 60
        while (read_record(param_store, handle.run_id) or {}).get("status") != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        said = rf"still running on the scheduler at {other.scheduler_address}.*vcdask\.attach\('{handle.run_id}'"
        # (the refusal comes before vcdask's plugin is registered on `client`, which answers vcdask_missing below:
        # registered here, the test does not depend on an earlier test's run on the shared cluster)
        ensure_plugin(client)
        with pytest.raises(RunLiveElsewhereError, match=said):
            vcdask.resume(handle.run_id, store=store, client=client, wait=False)
        assert client.sync(client.scheduler.vcdask_missing, run_id=handle.run_id) is not None  # nothing started
        assert handle.status()["status"] == "running"
        # a scheduler that has not the run going, or none at its address, is not in the way
        record = read_record(param_store, handle.run_id)
        check_not_live_elsewhere({**record, "scheduler": client.scheduler.address}, handle.run_id, there)
        t0 = time.monotonic()
        check_not_live_elsewhere({**record, "scheduler": "tcp://127.0.0.1:9"}, handle.run_id, client)
        assert time.monotonic() - t0 < ASK_TIMEOUT + 2
    # its scheduler closed under it: resumed here, it goes on
    assert read_record(param_store, handle.run_id)["stop_kind"] == "shutdown"
    more = vcdask.resume(handle.run_id, store=store, client=client, wait=False)
    assert more.status()["status"] in ("starting", "running")
    assert more.cancel() is True
