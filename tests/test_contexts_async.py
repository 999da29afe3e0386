"""vcdask from async code: an asynchronous Client used from its event loop is refused at once, saying to call
vcdask in a thread, where the same client works."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import vcdask

ASYNC = r"asynchronous here \(asynchronous=True, used from its event loop.*vcdask's calls block: "
SAID = ASYNC + "pass a synchronous Client"


def _data(n=160):
    X = np.random.default_rng(0).normal(size=(n, 4)).astype("float32")
    return X, (X[:, 0] > 0).astype("int64")


def _fit(client, store, **kw):
    torch.manual_seed(0)
    return vcdask.fit(
        torch.nn.Linear(4, 2), _data(), max_epochs=1, n_shards=2, client=client, store=store, progress=False, **kw
    )


def test_an_asynchronous_client_is_refused_in_its_event_loop_and_works_from_a_thread(tmp_path):
    """fit raised AttributeError ('coroutine' object has no attribute 'items'), a handle's status() returned a
    coroutine, done() raised TypeError, and attach(run_id, c) and attach(run_id) said falsely that the run did
    not exist."""
    store = tmp_path / "s"

    async def main():
        async with (
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False, asynchronous=True, dashboard_address=":0")
            as cluster,
            Client(cluster, asynchronous=True) as c,  # (the default client, too)
        ):  # fmt: skip
            with pytest.raises(TypeError, match=rf"{SAID}.*asyncio\.to_thread\(vcdask\.fit, model, data, client="):
                _fit(c, store)
            assert not store.exists()  # refused before any cluster work: nothing staged
            result = await asyncio.to_thread(_fit, c, store)  # what the message says works
            assert int(result.history["accepted"].sum()) == 2  # (trained: both shards merged)
            with pytest.raises(TypeError, match=SAID):
                vcdask.resume(result.run_id, store=store, client=c, max_epochs=2)
            for attach in (lambda: vcdask.attach(result.run_id, c), lambda: vcdask.attach(result.run_id)):
                with pytest.raises(TypeError, match=rf"{SAID}.*asyncio\.to_thread\(vcdask\.attach, run_id, client\)"):
                    attach()  # (not a RunNotFoundError: the run is there)
            handle = await asyncio.to_thread(_fit, c, store, wait=False)
            for ask in (handle.status, handle.done, handle.stop, handle.wait, handle.result):
                with pytest.raises(TypeError, match=rf"{ASYNC}await handle .*asyncio\.to_thread\(handle\.status\)"):
                    ask()
            again = await asyncio.to_thread(vcdask.attach, handle.run_id, c)
            ended = await handle  # (in a thread: works)
            assert (await again).version == ended.version
            assert handle.status()["status"] == "finished"  # (ended: kept, no client needed)

    asyncio.run(main())
