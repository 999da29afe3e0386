"""A preemption notice on a scheduler where no vcdask run has started: nothing to tell the runs, and the worker is
retired all the same (by ``vcdask.preempt``, and by the ``PreemptionWatcher`` on the provider's notice)."""

from __future__ import annotations

import time

import pytest
from distributed import Client, LocalCluster
from fake_metadata import FakeMetadata

import vcdask
from vcdask.cloud import PreemptionWatcher


def _workers(client) -> list[str]:
    return sorted(client.scheduler_info()["workers"])


def _retired(client, worker, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while worker in _workers(client):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _has_vcdask(dask_scheduler=None) -> bool:
    return "vcdask_preempt" in dask_scheduler.handlers


@pytest.fixture
def bare():
    """Two in-process workers on a scheduler no vcdask run has used (no vcdask plugin there)."""
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp://", dashboard_address=":0")
        as cluster,
        Client(cluster, set_as_default=False) as client,
    ):  # fmt: skip
        assert not client.run_on_scheduler(_has_vcdask)
        yield client


def test_preempt_on_a_scheduler_without_vcdask_retires_the_worker_and_returns_no_runs(bare):
    """It returned None (Dask's answer to a handler it lacks), not the documented dict, and retired nothing."""
    kept, victim = _workers(bare)
    assert vcdask.preempt(bare, kept, retire=False) == {}
    time.sleep(0.5)
    assert kept in _workers(bare)  # retire=False: left alone
    assert vcdask.preempt(bare, victim) == {}
    assert _retired(bare, victim) and _workers(bare) == [kept]


async def _watch(endpoint, dask_worker=None):
    await dask_worker.plugin_add(PreemptionWatcher(provider="aws", endpoint=endpoint, interval=0.1))


def test_the_watcher_retires_its_worker_on_a_notice_on_a_scheduler_without_vcdask(bare):
    """Its fallback (retiring) ran only when asking the runs raised; the scheduler answered None, and the worker
    stayed until the instance went."""
    kept, victim = _workers(bare)
    with FakeMetadata("aws") as at_victim:
        bare.run(_watch, at_victim.endpoint, workers=[victim])
        time.sleep(0.5)
        assert any("spot/instance-action" in p for p in at_victim.paths("GET"))  # (it watches)
        assert _workers(bare) == [kept, victim]
        at_victim.notify(120)
        assert _retired(bare, victim), "the worker was not retired after its notice"
    assert _workers(bare) == [kept]
