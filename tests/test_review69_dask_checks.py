"""fit's checks of dask data (its first rows, the labels' range, the NaN / inf scan) computed on the default
client, or in this process, not on the cluster of client=: with fit(client=B) and a default client A, the full
pass ran on A; without one, in the caller's process.  Only the staging ran on B.  They run on client='s cluster; a
cluster object or an address is connected to once, at the first computation, and the run runs on that Client."""

from __future__ import annotations

import time
from collections import Counter

import dask.array as da
import numpy as np
import pytest
import torch

import vcdask
from vcdask.data import DataError
from vcdask.options import plan
from vcdask.runs import launch

#: Which scheduler computed each block: its address, or "caller" outside any worker (this process).
seen: Counter[str] = Counter()


def tag(block):
    import distributed

    try:
        seen[distributed.get_worker().scheduler.address] += 1
    except ValueError:
        seen["caller"] += 1
    return block


def _tagged(a):
    """``a`` as a dask array whose blocks say where they were computed (meta given: dask calls no block here)."""
    return da.from_array(a, chunks=16).map_blocks(tag, meta=np.empty((0,) * a.ndim, a.dtype))


def _data(n, seed, classes=2):
    X = np.random.default_rng(seed).normal(size=(n, 5)).astype("float32")
    y = (X[:, 0] > 0).astype("int64") * (classes - 1)
    return X, y


@pytest.fixture
def clusters():
    """Two in-process clusters: A with the default client, B for client=."""
    from distributed import Client, LocalCluster

    kw = dict(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0")
    with LocalCluster(**kw) as a, LocalCluster(**kw) as b, Client(a), Client(b, set_as_default=False) as c:
        seen.clear()
        yield a, b, c


def _clients(cluster) -> int:
    return len([c for c in cluster.scheduler.clients if not c.startswith("fire-and-forget")])


def _settled(cluster, count) -> bool:
    deadline = time.monotonic() + 20
    while _clients(cluster) != count and time.monotonic() < deadline:
        time.sleep(0.1)
    return _clients(cluster) == count


def test_the_checks_of_dask_data_compute_on_the_cluster_of_client(clusters, tmp_path):
    a, b, client = clusters
    (X, y), (Xv, yv) = _data(96, 0), _data(48, 1)
    data, validation = (_tagged(X), _tagged(y)), (_tagged(Xv), _tagged(yv))
    model = torch.nn.Linear(5, 2)

    planned = plan(model, data, validation=validation, client=client, store=tmp_path / "s")
    assert set(seen) == {b.scheduler_address} and seen[b.scheduler_address] >= 2 * (96 + 48) // 16
    assert planned.client is None  # (a Client given is used as it is)

    for given in (b.scheduler_address, b):  # an address, a cluster object: connected to once
        seen.clear()
        before = _clients(b)
        planned = plan(model, data, validation=validation, client=given, store=tmp_path / "s")
        assert set(seen) == {b.scheduler_address}
        assert planned.client.scheduler.address == b.scheduler_address and _clients(b) == before + 1
        planned.client.close()
        assert _settled(b, before)

    # without client=, the run goes to the embedded cluster, on this machine: computed here, not on the default A
    seen.clear()
    plan(model, data, validation=validation, store=tmp_path / "s")
    assert set(seen) == {"caller"}


def test_an_address_is_connected_to_only_for_data_to_compute_and_closed_on_a_refusal(clusters, tmp_path):
    a, b, client = clusters
    X, y = _data(64, 0)
    # data in memory: nothing to compute, nothing connected (no scheduler listens there)
    assert plan(torch.nn.Linear(5, 2), (X, y), client="tcp://127.0.0.1:1", store=tmp_path / "s").client is None
    before = _clients(b)
    X, y = _data(64, 0, classes=4)  # labels 0 and 3: out of range of 2 outputs, refused after computing them on B
    with pytest.raises(DataError, match=r"labels range over \[0, 3\]"):
        plan(torch.nn.Linear(5, 2), (_tagged(X), _tagged(y)), client=b.scheduler_address, store=tmp_path / "s")
    assert set(seen) == {b.scheduler_address}
    assert _settled(b, before)  # (the Client connected for the checks was closed)


def test_a_run_on_dask_data_checks_stages_and_trains_on_the_cluster_of_client(clusters, tmp_path):
    a, b, client = clusters
    (X, y), (Xv, yv) = _data(96, 0), _data(48, 1)
    data, validation = (_tagged(X), _tagged(y)), (_tagged(Xv), _tagged(yv))
    kw = dict(max_epochs=1, n_shards=2, store=tmp_path / "s", progress=False)
    result = vcdask.fit(torch.nn.Linear(5, 2), data, validation=validation, client=client, **kw)
    assert len(result.epochs) == 1 and set(seen) == {b.scheduler_address}

    # the run starts on the Client its checks connected, not on a second one, and its handle owns it
    seen.clear()
    model = torch.nn.Linear(5, 2)
    planned = plan(model, data, validation=validation, client=b.scheduler_address, max_epochs=1, store=tmp_path / "s")
    handle = launch(planned, b.scheduler_address, model, wait=False, progress=False)
    assert handle.client is planned.client
    assert len(handle.result().epochs) == 1 and set(seen) == {b.scheduler_address}
    assert planned.client.status == "closed"
