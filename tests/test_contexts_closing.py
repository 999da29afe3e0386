"""A run's handle whose client is closed while a thread waits on it: the waiting thread hears what a later call
would (the client was closed; how to reach the run again), not distributed's bare ``CommClosedError('')``."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import vcdask
from vcdask.cluster import close_embedded


def _data(n=160):
    X = np.random.default_rng(0).normal(size=(n, 4)).astype("float32")
    return X, (X[:, 0] > 0).astype("int64")


def _slow(epoch, step):
    """An lr_schedule whose steps take 20 ms: a run of many epochs goes on until it is stopped."""
    import time

    time.sleep(0.02)
    return 1.0


def _long_run(store, client=None):
    torch.manual_seed(0)
    return vcdask.fit(
        torch.nn.Linear(4, 2), _data(), max_epochs=400, n_shards=2, lr_schedule=_slow, client=client, store=store,
        wait=False, progress=False,
    )  # fmt: skip


def _waiters(handle) -> tuple[list[threading.Thread], dict[str, BaseException]]:
    """Threads blocked on ``handle`` every way one can be: result(), wait(), ``await handle``, a done callback's
    watcher; what each raised, by way."""
    heard: dict[str, BaseException] = {}

    def keep(way, call):
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - what the test looks at
            heard[way] = e

    def awaited():
        async def main():
            return await handle

        asyncio.run(main())

    ways = {"result": handle.result, "wait": handle.wait, "await": awaited}
    threads = [threading.Thread(target=keep, args=(way, call), daemon=True) for way, call in ways.items()]
    for t in threads:
        t.start()
    called = threading.Event()
    handle.add_done_callback(lambda _handle: called.set())
    threads.append(threading.Thread(target=called.wait, daemon=True))  # (joined: the callback was called)
    threads[-1].start()
    return threads, heard


def _joined(threads, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a waiter still waits after its client was closed"


def test_threads_waiting_on_a_run_hear_that_its_client_was_closed_and_how_to_attach(tmp_path, monkeypatch):
    excepthook_saw = []
    monkeypatch.setattr(threading, "excepthook", lambda args: excepthook_saw.append(args.exc_value))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster, set_as_default=False) as client:
            handle = _long_run(tmp_path / "s", client)
            threads, heard = _waiters(handle)
            time.sleep(1.0)  # (all of them inside their wait for the scheduler's answer)
            assert heard == {} and handle.status()["status"] in ("starting", "running")
        _joined(threads)
        said = rf"client of this handle of run {handle.run_id} was closed; the run goes on on its scheduler: "
        said += rf"vcdask\.attach\('{handle.run_id}', '{cluster.scheduler_address}'\)"
        assert sorted(heard) == ["await", "result", "wait"]
        for way, error in [*heard.items(), *(("add_done_callback", e) for e in excepthook_saw)]:
            assert isinstance(error, RuntimeError), (way, repr(error))
            assert re.search(said, str(error)), (way, str(error))
        assert len(excepthook_saw) == 1  # (the done callback's watcher, then the callback was called)
        again = vcdask.attach(handle.run_id, cluster.scheduler_address)  # what the message says works
        assert again.cancel() is True


@pytest.mark.cluster
@pytest.mark.slow
def test_a_thread_waiting_on_a_run_of_the_embedded_cluster_hears_it_was_closed_and_how_to_resume(tmp_path, monkeypatch):
    excepthook_saw = []
    monkeypatch.setattr(threading, "excepthook", lambda args: excepthook_saw.append(args.exc_value))
    handle = _long_run(tmp_path / "s")
    threads, heard = _waiters(handle)
    time.sleep(1.0)
    with pytest.warns(RuntimeWarning, match=rf"runs \['{handle.run_id}'\] are still going"):
        close_embedded()
    _joined(threads)
    assert sorted(heard) == ["await", "result", "wait"] and len(excepthook_saw) == 1
    for way, error in [*heard.items(), ("add_done_callback", excepthook_saw[0])]:
        assert isinstance(error, RuntimeError), (way, repr(error))
        assert f"the embedded cluster of run {handle.run_id} was closed" in str(error), way
        assert f"vcdask.resume('{handle.run_id}', store=<its store>) continues it" in str(error), way
