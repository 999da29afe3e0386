"""The run's core and the workers Dask says it has: a copy lost with its worker names it in the history,
workers Dask has paused get no shards (the run waits, says why, and fails past ``no_worker_timeout``), and
a copy that never started is sent again only where it can start, at most one such copy per shard or
validation.  Scripted events, no cluster (the helpers are ``test_engine_core``'s)."""

from __future__ import annotations

from test_engine_core import Script, _Worker, emitted, keys, rows

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


def _cancelled(effects: list[m.Effect]) -> list[str]:
    return [k for fx in effects if isinstance(fx, m.Cancel) for k in fx.keys]


def _unstarted(s: Script) -> dict[tuple[str, int, int], int]:
    """Copies in flight that never started, per shard (epoch, shard) or validation (step)."""
    seen: dict[tuple[str, int, int], int] = {}
    for t in s.state.tasks.records.values():
        if not t.began and not t.overdue:
            what = ("update", t.epoch, t.shard) if t.kind == "update" else ("validation", t.step, 0)
            seen[what] = seen.get(what, 0) + 1
    return seen


def test_workers_dask_paused_are_not_usable_the_run_pauses_saying_why_sends_nothing_and_fails_past_the_timeout():
    """Every worker paused by Dask's memory manager (it starts no task there): the run pauses at once, says why
    in its status, sends no copy (not every patience, as it did: the queue grew without bound), and fails
    past ``no_worker_timeout`` naming the cause.  A worker running again is usable again."""
    s = Script(n_shards=6, no_worker_timeout=30.0)
    assert len(keys(s(m.Poll()))) == 2
    paused = {"a": ("paused", 1), "b": ("paused", 1)}
    s(m.Tick(paused))
    assert s.state.pool.usable() == [] and not s.state.pool.room()
    effects = s(m.Poll())
    [why] = [e["why"] for e in emitted(effects, "paused")]
    assert "every worker is paused by Dask's memory manager" in why and keys(effects) == []
    for _ in range(5):
        s.clock.advance(5.0)
        assert keys(s(m.Tick(paused))) == [] and keys(s(m.Poll())) == []
    assert "every worker is paused by Dask's memory manager" in s.state.no_workers
    assert s.state.tasks.training() == 2  # the two copies out at first, no more
    s(m.Tick({"a": ("running", 1), "b": ("paused", 1)}))
    effects = s(m.Poll())
    assert emitted(effects, "resumed") and s.state.pool.usable() == ["a"] and s.state.no_workers is None
    s(m.Tick({"a": ("closing_gracefully", 1), "b": ("paused", 1)}))
    s(m.Poll())
    assert s.state.pool.unusable()["a"] == "closing_gracefully (its Dask status)"
    s.clock.advance(31.0)
    [fail] = [fx for fx in s(m.Poll()) if isinstance(fx, m.Fail)]
    assert "had no usable worker for 30 s (no_worker_timeout; connected workers: " in fail.failure.message
    assert fail.failure.message.endswith(
        ": 1 closing_gracefully (its Dask status), 1 paused by Dask's memory manager (distributed.worker.memory.pause)"
    )


def test_a_copy_that_never_started_is_sent_again_only_where_a_thread_is_free_and_replaces_the_one_it_was():
    """Another client's tasks hold every thread: a copy that never started waits (a second copy would wait as
    well; one more every patience piled up at the scheduler).  Once a thread is free somewhere it is sent
    again and the copy it replaces is cancelled (recorded as such): at most one copy of a shard that has not
    started waits, however often it is replaced."""
    s = Script(n_shards=6)
    first = keys(s(m.Poll()))
    busy = {"a": ("running", 0), "b": ("running", 0)}
    for _ in range(5):
        s.clock.advance(200.0)  # (past the patience of a copy: 3 deadlines of 60 s, nothing measured yet)
        effects = s(m.Tick(busy))
        assert keys(effects) == [] and _cancelled(effects) == [] and not emitted(effects, "reissue")
    assert sorted(s.state.tasks.records) == sorted(first)
    for _ in range(3):
        s.clock.advance(200.0)
        effects = s(m.Tick({"a": ("running", 0), "b": ("running", 1)}))
        cancelled = _cancelled(effects)
        assert len(keys(effects)) == 2 and len(cancelled) == 2 and not set(cancelled) & set(s.state.tasks.records)
        assert all(n == 1 for n in _unstarted(s).values()) and len(s.state.tasks.records) == 2
    assert [r["reason"] for r in rows(s.state, "cancelled")] == ["cancelled: it never started; sent again"] * 6
    # a replaced copy reported cancelled by Dask later is not sent a third time
    effects = s(m.Completed(first[0], cancelled=True))
    assert keys(effects) == [] and len(s.state.tasks.records) == 2


def test_a_validation_that_never_started_is_run_again_only_where_a_thread_is_free_and_replaces_the_one_it_was():
    from vcdask.engine.core.dispatching import submit_validation

    s = Script(workers=("a", "b"), validation=object())
    submit_validation(s.state, "v0", 0)
    [first] = s.dask.sent(s.state.out)
    for _ in range(5):
        s.clock.advance(200.0)
        assert keys(s(m.Tick({"a": ("running", 0), "b": ("running", 0)}))) == []
    effects = s(m.Tick({"a": ("running", 0), "b": ("running", 1)}))
    [again] = [fx for fx in effects if isinstance(fx, m.Submit)]
    assert again.kind == "validation" and [fx.keys for fx in effects if isinstance(fx, m.Cancel)] == [(first.key,)]
    assert list(s.state.tasks.records) == [again.key]
    assert keys(s(m.Completed(first.key, cancelled=True))) == []  # not validated a third time
