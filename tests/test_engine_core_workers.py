"""The run's core and the workers Dask says it has: a copy lost with its worker names it in the history,
workers Dask has paused get no shards (the run waits, says why, and fails past ``no_worker_timeout``), and
a copy that never started is sent again only where it can start, at most one such copy per shard or
validation.  Scripted events, no cluster (the helpers are ``test_engine_core``'s)."""

from __future__ import annotations

from test_engine_core import Script, _Worker, keys, rows

from vcdask.engine.core import messages as m


def test_a_copy_lost_to_killed_worker_names_the_worker_it_started_on_in_the_history():
    """Dask gave up on a copy whose worker died running it (``KilledWorker``): its history row names that
    worker (``result.workers`` already counted the failure against it); a copy only queued there names the
    worker Dask says died."""
    from distributed.scheduler import KilledWorker

    s = Script()
    started, queued = keys(s(m.Poll()))
    s.start(started, "a")
    for key, dead in ((started, "a"), (queued, "b")):
        task = s.state.tasks.records[key]
        s(m.Completed(key))
        s(m.TaskFailed(task, KilledWorker(key, _Worker(dead), 0)))
    assert [r["worker"] for r in rows(s.state, "lost")] == ["a", "b"]
