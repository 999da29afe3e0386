"""A run on a cluster whose every worker Dask has paused (its memory manager does so past
``distributed.worker.memory.pause``; here the test sets the status itself): the run pauses and says why,
sends no copy where nothing can start it, and fails after ``no_worker_timeout``.  It used to count paused
workers as usable: a copy every few seconds piled up at the scheduler, and the run never timed out."""

from __future__ import annotations

import time

import pytest
from chaos_helpers import running_run
from distributed import Client

import vcdask
from vcdask.cluster import embedded_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _pause(dask_worker) -> None:
    from distributed.core import Status

    dask_worker.memory_manager.memory_pause_fraction = False  # (its memory monitor would resume it)
    dask_worker.status = Status.paused


def _copies_out(dask_scheduler) -> int:
    """The run's shard copies the scheduler holds, not finished."""
    waiting = ("queued", "processing", "no-worker", "waiting", "released")
    return sum(1 for k, ts in dask_scheduler.tasks.items() if "vcdask-train" in str(k) and ts.state in waiting)


def test_every_worker_paused_by_dask_pauses_the_run_with_no_copies_sent_and_fails_past_no_worker_timeout(
    digits_data, tmp_path
):
    from vcdask.demo import digits_cnn

    (X, y), _ = digits_data
    # a copy that never starts would be sent again after 3 s (3 deadlines of 1 s): well within the 8 s wait
    res = vcdask.Resilience(no_worker_timeout=8, deadline=1.0)
    with embedded_cluster(n_workers=2) as cluster, Client(cluster, set_as_default=False) as client:
        handle = vcdask.fit(
            model=digits_cnn(7),
            data=(X, y),
            client=client,
            store=tmp_path / "s",
            resilience=res,
            max_epochs=50,
            n_shards=8,
            local_epochs=1,
            progress=False,
            retention=False,
            wait=False,
        )
        try:
            running_run(client, timeout=120, min_step=1)
            client.run(_pause)
            paused_for, copies, t0 = set(), [], time.monotonic()
            while not handle.done() and time.monotonic() - t0 < 60:
                paused_for.add(handle.status()["paused"])
                copies.append(client.run_on_scheduler(_copies_out))
                time.sleep(0.5)
            assert handle.done(), (handle.status(), copies)
            waited = time.monotonic() - t0
            with pytest.raises(vcdask.RunFailedError) as err:
                handle.result(timeout=30)
        finally:
            handle.cancel()
    assert max(copies) <= 4, copies  # (the two slots' copies, and at most one sent with a hand-over each)
    assert any("every worker is paused by Dask's memory manager" in (why or "") for why in paused_for), paused_for
    assert 8 <= waited < 30
    assert "NoWorkersError" in str(err.value) and "no usable worker for 8 s (no_worker_timeout" in str(err.value)
    assert "every worker is paused by Dask's memory manager" in str(err.value)
