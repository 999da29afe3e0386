"""fit(wait=False): the RunHandle as a future: returns before the first merge, result(), cancel(), await."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import time

import numpy as np
import pytest
import torch

import vcdask
from vcdask.errors import RunCancelledError
from vcdask.result import HISTORY_COLUMNS


def _data(n=240, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 8)).astype("float32")
    y = (X[:, 0] + X[:, 1] > 0).astype("int64")
    return X, y


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _slow_first_step(seconds):
    """An lr_schedule whose first local step of epoch 1 sleeps: no merge can land for ``seconds``."""

    def schedule(epoch, step):
        import time

        if epoch == 1 and step == 0:
            time.sleep(seconds)
        return 1.0

    return schedule


def test_wait_false_returns_before_the_first_merge_and_result_matches_a_blocking_run(client, tmp_path):
    X, y = _data()
    store = tmp_path / "store"
    kw = dict(max_epochs=2, n_shards=4, validation=0.25, lr=0.02, client=client, store=store, progress=False, seed=3)
    model = _model()
    handle = vcdask.fit(model, (X, y), lr_schedule=_slow_first_step(1.5), wait=False, **kw)
    # returned at once: the initial version is committed, nothing merged yet
    assert isinstance(handle, vcdask.RunHandle)
    status = handle.status()
    assert status["step"] == 0 and status["epochs_done"] == 0
    initial = vcdask.open_store(str(store)).versions(handle.run_id)
    assert [v.metadata["step"] for v in initial] == [0]
    assert status["version"] == initial[0].id  # shown as the run's version from the start (it was None)
    assert not handle.done() and not handle.cancelled()
    with pytest.raises(TimeoutError, match="still"):
        handle.result(timeout=0.05)

    called = threading.Event()
    from_callback = []

    def collect(h):  # collects at the same time as `await handle` below: one collection, one result
        from_callback.append(h.result())
        called.set()

    handle.add_done_callback(collect)

    async def main():
        return await handle  # the event loop stays free meanwhile

    result = asyncio.run(main())
    assert called.wait(10)
    assert handle.done() and not handle.cancelled()
    assert handle.result() is result and from_callback == [result]  # collected once, under a lock
    assert result.model is model  # the caller's model holds the final version
    assert model.vcdask_version["id"] == result.version
    # the same keys vcdask.load gives
    loaded_version = vcdask.load(str(store), _model(), version=result.version).vcdask_version
    assert set(loaded_version) <= set(model.vcdask_version) and model.vcdask_version["step"] == 8
    assert model.vcdask_version["epoch"] == loaded_version["epoch"]
    with pytest.raises(TypeError, match="model="):
        handle.result(_model())  # the first argument is timeout

    def held(dask_scheduler=None, run_id=handle.run_id):
        return dask_scheduler.plugins["vcdask"].footprint(run_id)

    # a finished run keeps no parameter-sized arrays on the scheduler, only its small result
    assert client.run_on_scheduler(held) == {"params": 0, "rule_state": 0, "bases": 0, "model": 0}
    res = client.sync(client.scheduler.vcdask_result, run_id=handle.run_id)
    assert res["version"] == result.version and res["status"] == "finished" and len(res["history"]) == 8
    assert client.sync(client.scheduler.vcdask_status, run_id=handle.run_id)["step"] == 8
    final = vcdask.load(str(store), branch=result.run_id)
    for a, b in zip(final.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)

    blocking = vcdask.fit(_model(), (X, y), lr_schedule=_slow_first_step(0.0), **kw)
    for r in (result, blocking):
        assert list(r.history.columns) == HISTORY_COLUMNS
        assert int(r.history["accepted"].sum()) == 2 * 4
        assert list(r.epochs.index) == [1, 2]
        assert r.stop_reason is None
    assert list(result.epochs.columns) == list(blocking.epochs.columns)
    # arrival order differs between runs: close, not equal
    assert abs(result.metrics["accuracy"] - blocking.metrics["accuracy"]) < 0.2
    assert result.metrics["accuracy"] > 0.6  # it learned (chance: 0.5; a CI run under load measured 0.68)


def test_cancel_stops_the_run_and_leaves_the_store_readable_at_its_head(cluster, tmp_path):
    """Given a cluster object (not a client), the handle owns the client fit opened and closes it."""
    client = cluster[1]
    X, y = _data()
    store = tmp_path / "store"

    handle = vcdask.fit(
        _model(),
        (X, y),
        max_epochs=50,
        n_shards=4,
        lr_schedule=_slow_schedule,
        client=cluster[0],
        store=store,
        wait=False,
    )
    assert handle.client is not client
    while handle.status()["step"] < 2:
        assert not handle.done(), handle.status()
    assert handle.cancel() is True
    assert handle.client.status == "closed"  # the handle's own client, closed once the run ended
    status = handle.status()
    assert status["status"] == "cancelled" and handle.cancelled() and handle.done()
    assert status["epochs_done"] < 50
    with pytest.raises(RunCancelledError, match="cancelled") as info:
        handle.result()
    assert isinstance(info.value, concurrent.futures.CancelledError)
    # the store stays readable at the run's head: the version the run committed last
    param_store = vcdask.open_store(str(store))
    loaded = vcdask.load(param_store, branch=handle.run_id)
    ids = [v.id for v in param_store.versions(handle.run_id)]
    assert loaded.vcdask_version["id"] == ids[0] == status["version"]
    assert loaded.vcdask_version["step"] >= 2
    assert handle.cancel() is True  # already cancelled (as a Future answers)
    assert handle.stop() == status  # nothing to stop: how it ended, without the closed client
    from vcdask.panel import RunPanel

    panel = RunPanel(handle, display=False)  # made of what the handle kept: its client is closed
    assert panel._closed and panel.state.status["status"] == "cancelled" and "cancelled" in panel.header.value
    assert panel.state.epochs_done == status["epochs_done"] and panel.state.metric == "train_loss"
    assert sum(s == "merged" for e in panel.state.grid_epochs() for s in panel.state.grid(e)) >= 2
    # no shard of the run is left on the cluster
    assert not [k for keys in client.processing().values() for k in keys if handle.run_id in str(k)]


def test_a_client_opened_for_a_cluster_is_closed_when_the_launch_fails(cluster):
    """resolve_client(keep=True) hands its client over only when the launch succeeds."""
    from vcdask.cluster import owns_client, resolve_client

    opened = []
    with pytest.raises(RuntimeError, match="staging failed"), resolve_client(cluster[0], keep=True) as c:
        opened.append(c)
        raise RuntimeError("staging failed")
    assert opened[0].status == "closed"
    with resolve_client(cluster[0], keep=True) as c:
        pass
    assert c.status == "running" and owns_client(cluster[0]) and not owns_client(cluster[1])
    c.close()
    with resolve_client(cluster[1], keep=True) as c:
        assert c is cluster[1]  # a Client you pass is yours


def test_a_dropped_handle_closes_the_client_it_owns(cluster, tmp_path):
    """``fit(client=<cluster>, wait=False)`` opens a client that its handle owns.  A handle dropped without
    ``close()`` (such fits in a loop, a notebook cell run again) left that client open and connected for good:
    one more client on the scheduler each time.  A handle you passed a Client to leaves it open."""
    import gc

    handle = vcdask.fit(
        _model(), _data(), client=cluster[0], wait=False, store=tmp_path / "s", max_epochs=1, progress=False
    )
    owned = handle.client
    handle.wait()
    del handle
    gc.collect()
    assert owned.status == "closed"
    handle = vcdask.fit(
        _model(), _data(), client=cluster[1], wait=False, store=tmp_path / "s", max_epochs=1, progress=False
    )
    handle.wait()
    del handle
    gc.collect()
    assert cluster[1].status == "running"


def test_a_client_two_handles_use_is_closed_when_the_last_lets_go(cluster, tmp_path):
    """``attach(run_id, handle.client)`` uses the client a fit's handle owns: dropping the fit's handle closed it
    under the second one's feet ('the client of this handle ... was closed')."""
    handle = vcdask.fit(
        _model(), _data(), client=cluster[0], wait=False, store=tmp_path / "s", max_epochs=1, progress=False
    )
    owned = handle.client
    second = vcdask.attach(handle.run_id, owned)
    del handle
    gc.collect()
    assert owned.status == "running" and second.result().run_id == second.run_id
    del second
    gc.collect()
    assert owned.status == "closed"


def test_a_handle_collected_on_its_clients_event_loop_closes_the_client(cluster):
    """A handle in a reference cycle (its progress display refers to it) is freed by a garbage collection, which
    may run on the client's own event-loop thread: there ``client.close()`` only made a coroutine nobody awaited,
    and the client stayed 'closing', connected."""
    from distributed import Client

    from vcdask import RunHandle

    client = Client(cluster[0].scheduler_address, set_as_default=False)
    handle = RunHandle("run-none", client, owns_client=True)
    handle.display = [handle]  # (a cycle, as a RunPanel's)
    gc.disable()
    try:
        del handle
        client.loop.add_callback(gc.collect)
        deadline = time.monotonic() + 30
        while client.status != "closed":
            assert time.monotonic() < deadline, client.status
            time.sleep(0.05)
    finally:
        gc.enable()


def _step(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _slow_schedule(epoch, step):
    """A learning-rate schedule of factor 1 that takes 20 ms a step: a run long enough to act on while it trains."""
    import time

    time.sleep(0.02)
    return 1.0


def _slow_eval(model, batch):
    """An eval_step that takes half a second a batch (a large validation set, a slow model)."""
    import time

    time.sleep(0.5)
    return {"loss": _step(model, batch)}


def test_a_stopped_run_validates_its_final_version_once_however_long_that_takes(client, tmp_path, caplog):
    """A run stopped mid-epoch validates its head as it ends.  That validation was taken for lost unless
    it finished within a quarter of a second: each attempt was cancelled and sent again, and after 1,000
    the run failed (a stopped run, a time limit, a Ctrl-C)."""
    X, y = _data(n=1200)

    handle = vcdask.fit(
        _model(),
        (X, y),
        validation=0.25,
        train_step=_step,
        eval_step=_slow_eval,
        max_epochs=50,
        n_shards=20,
        lr_schedule=_slow_schedule,
        client=client,
        store=tmp_path / "store",
        wait=False,
        progress=False,
    )
    while handle.status()["step"] < 2:
        assert not handle.done(), handle.status()
    with caplog.at_level("WARNING", logger="vcdask.engine.results"):
        handle.stop("the test stops it")
        result = handle.result(timeout=90)
    assert result.stop_reason == "the test stops it" and len(result.epochs) < 50
    final = result.store.read(result.version).metadata["step"]
    assert final % 20 != 0  # (mid-epoch: no epoch's validation covered it)
    assert np.isfinite(result.metrics["loss"])
    assert not [r for r in caplog.records if "final validation" in r.getMessage()], caplog.text


@pytest.mark.cluster
@pytest.mark.parametrize("workers_leave", ["before the stop", "during the final validation"])
def test_a_run_asked_to_stop_with_no_worker_left_ends_at_once_without_its_final_validation(tmp_path, workers_leave):
    """A run stopped (``stop()``, Ctrl-C, a time limit) whose workers had all gone waited for one to validate its
    head: a Ctrl-C its whole interrupt grace (60 s), the validation sent again every 10 s, and the run failed at
    ``no_worker_timeout``.  It ends at once, stopped, its merged work committed, its final version not validated."""
    from distributed import Client

    from vcdask.cluster import embedded_cluster
    from vcdask.engine.end import read_record

    X, y = _data(n=1200)
    with embedded_cluster(n_workers=1) as cluster, Client(cluster, set_as_default=False) as client:
        handle = vcdask.fit(
            _model(), (X, y), validation=0.25, train_step=_step, eval_step=_slow_eval, validate_every=1000,
            max_epochs=50, n_shards=20, lr_schedule=_slow_schedule, client=client, store=tmp_path / "store",
            wait=False, progress=False,
        )  # fmt: skip
        while handle.status()["step"] < 2:
            assert not handle.done(), handle.status()
        if workers_leave == "before the stop":
            cluster.scale(0)
            while client.scheduler_info()["workers"]:
                time.sleep(0.05)
            handle.stop("the test stops it")
        else:
            handle.stop("the test stops it")
            final = f"validate-{handle.run_id}-final-"
            while not any(final in str(k) for ks in client.processing().values() for k in ks):
                time.sleep(0.05)
            cluster.scale(0)
        began = time.monotonic()
        result = handle.result(timeout=60)
        assert time.monotonic() - began < 15
    assert result.stop_reason == "the test stops it" and result.metrics == {}
    merged = result.store.read(result.version).metadata["step"]
    assert merged >= 2  # what it merged is committed, and loads
    assert read_record(result.store, result.run_id)["status"] == "stopped"


def test_a_resume_of_a_run_still_ending_waits_for_its_end_then_trains_on(client, tmp_path):
    """``resume(run_id)`` just after ``stop()``, while the run still ends (here: its final validation), returned
    that session's result and trained nothing: it waits for the run's end, then goes on from what it committed."""
    X, y = _data()
    store = tmp_path / "store"

    handle = vcdask.fit(
        _model(), (X, y), validation=0.25, train_step=_step, eval_step=_slow_eval, max_epochs=2, n_shards=8,
        batch_size=64, lr_schedule=_slow_schedule, client=client, store=store, wait=False, progress=False,
    )  # fmt: skip
    while handle.status()["step"] < 2:
        assert not handle.done(), handle.status()
    assert handle.stop("the test stops it")["status"] == "running"  # (its final validation takes 0.5 s a batch)
    result = vcdask.resume(handle.run_id, store=store, client=client, progress=False)
    assert result.stop_reason is None and list(result.epochs.index) == [1, 2]
    merged = result.store.read(result.version).metadata["step"]
    assert merged == 2 * 8  # every shard of both epochs merged, once


def _plugin_id(dask_scheduler=None):
    from vcdask.engine.plugin import PLUGIN_NAME

    return id(dask_scheduler.plugins[PLUGIN_NAME])


def test_a_second_registration_of_the_plugin_keeps_the_one_that_drives_the_runs(client):
    """Two clients starting their first runs at once both find no plugin and both register one: the
    second replaced the first, took over its handlers and orphaned the runs it drove."""
    from vcdask.engine.plugin import PLUGIN_NAME, VcdaskPlugin
    from vcdask.handle import ensure_plugin

    ensure_plugin(client)
    first = client.run_on_scheduler(_plugin_id)
    client.register_plugin(VcdaskPlugin(), name=PLUGIN_NAME)  # (the other client, past the same check)
    assert client.run_on_scheduler(_plugin_id) == first


def _run_topics(cluster) -> dict[str, int]:
    """Run id -> how many of the scheduler's event topics are that run's (its own, its client's)."""
    found: dict[str, int] = {}
    for name in cluster.scheduler._broker._topics:
        for prefix in ("vcdask-run-", "Client-vcdask-"):
            if name.startswith(prefix):
                run_id = name.removeprefix(prefix)[: len("run-20260101-000000-abcdef")]
                found[run_id] = found.get(run_id, 0) + 1
    return found


def test_a_scheduler_keeps_only_the_newest_ended_runs(tmp_path):
    """Beyond ``vcdask.scheduler.ended-runs-kept`` the oldest ended runs whose result was collected are dropped
    from the scheduler's memory (a long-lived scheduler running scheduled jobs grew by each run's history); a
    dropped run is not found, and the error says why and where its versions are; its event topics are dropped
    from the scheduler too; the newest stay attachable; a bad setting fails the start."""
    import dask.config
    from distributed import Client, LocalCluster

    from vcdask.errors import RunNotFoundError

    X, y = _data()
    fit = dict(max_epochs=1, n_shards=2, store=tmp_path / "store", progress=False)
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
        dask.config.set({"vcdask.scheduler.ended-runs-kept": 2}),
    ):
        ids = [vcdask.fit(_model(i), (X, y), client=client, **fit).run_id for i in range(3)]
        assert sorted(client.sync(client.scheduler.vcdask_runs)) == sorted(ids[1:])
        with pytest.raises(RunNotFoundError) as gone:
            vcdask.attach(ids[0], client)
        said = str(gone.value)
        assert f"no vcdask run {ids[0]!r}" in said and "1 ended runs were dropped" in said
        assert "vcdask.scheduler.ended-runs-kept=2" in said and "vcdask.load(store, branch=run_id)" in said
        assert vcdask.attach(ids[2], client).result().run_id == ids[2]
        assert vcdask.open_store(tmp_path / "store", mode="r").head(ids[0])  # its versions stay in the store
        # its event topics went with it (the scheduler kept them for good): the run's and its client's; a kept
        # run keeps its own, not its client's once the client has left
        assert _run_topics(cluster) == {run_id: 1 for run_id in ids[1:]}
        # neither a run still going nor an ended one whose result nobody collected yet is dropped; a fit's own
        # run is collected by it first, even when no ended run is kept
        with dask.config.set({"vcdask.scheduler.ended-runs-kept": 0}):
            slow = vcdask.fit(_model(3), (X, y), client=client, lr_schedule=_slow_first_step(2.0), wait=False, **fit)
            assert vcdask.fit(_model(4), (X, y), client=client, **fit).run_id not in ids
            assert list(client.sync(client.scheduler.vcdask_runs)) == [slow.run_id]
            assert slow.wait()["status"] == "finished"
            vcdask.fit(_model(5), (X, y), client=client, **fit)
            assert list(client.sync(client.scheduler.vcdask_runs)) == [slow.run_id]  # ended, not collected
            assert slow.result().run_id == slow.run_id
            assert client.sync(client.scheduler.vcdask_runs) == {}
            assert _run_topics(cluster) == {}
            # a handle of fit dropped (or closed) without its result lets go of the run, as a dropped Future
            # does (each was kept for the scheduler's life: a fit interrupted with Ctrl-C, a handle left behind)
            dropped = vcdask.fit(_model(6), (X, y), client=client, wait=False, **fit)
            assert dropped.wait()["status"] == "finished"
            attached = vcdask.attach(dropped.run_id, client)  # (its hold goes; the fit's handle still holds it)
            del attached
            gc.collect()
            assert list(client.sync(client.scheduler.vcdask_runs)) == [dropped.run_id]
            del dropped
            gc.collect()
            assert client.sync(client.scheduler.vcdask_runs) == {}
            with vcdask.fit(_model(7), (X, y), client=client, wait=False, **fit) as closed:
                assert closed.wait()["status"] == "finished"
            assert client.sync(client.scheduler.vcdask_runs) == {}
            # an attached handle holds the run too: the fit's handle dropped does not take its result away
            first = vcdask.fit(_model(9), (X, y), client=client, wait=False, **fit)
            attached = vcdask.attach(first.run_id, client)
            del first
            gc.collect()
            assert attached.wait()["status"] == "finished" and attached.result().run_id
            # a resumed run's session is held by the resume's handle: the earlier session's handle, dropped,
            # lets go of that session only (its release dropped the new session once it ended)
            earlier = vcdask.fit(_model(10), (X, y), client=client, wait=False, **fit)
            earlier.wait()
            later = vcdask.resume(earlier, client=client, store=fit["store"], max_epochs=2, wait=False, progress=False)
            del earlier
            gc.collect()
            assert later.wait()["status"] == "finished" and later.result().run_id == later.run_id
        with dask.config.set({"vcdask.scheduler.ended-runs-kept": -1}):
            with pytest.raises(ValueError, match=r"ended-runs-kept must be an integer >= 0, got -1"):
                vcdask.fit(_model(8), (X, y), client=client, **fit)
