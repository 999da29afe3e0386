"""Dispatch and the worker pool (vcdask.engine.dispatch / pool): queues, homes, placement, exclusion."""

from __future__ import annotations

from vcdask import Resilience
from vcdask.engine.dispatch import Dispatcher
from vcdask.engine.pool import WorkerPool


def _drain(d: Dispatcher, worker=None) -> list[tuple[int, int]]:
    out = []
    while (nxt := d.next_shard(worker)) is not None:
        out.append(nxt)
    return out


def test_every_epoch_hands_out_every_shard_once_in_a_seeded_order():
    handed = _drain(Dispatcher(n_shards=5, max_epochs=3, seed=1))
    assert len(handed) == 15
    for epoch in (1, 2, 3):
        assert sorted(s for e, s in handed if e == epoch) == [0, 1, 2, 3, 4]
    assert [e for e, _ in handed] == [1] * 5 + [2] * 5 + [3] * 5  # epochs in order
    assert handed == _drain(Dispatcher(n_shards=5, max_epochs=3, seed=1))  # seeded
    assert handed != _drain(Dispatcher(n_shards=5, max_epochs=3, seed=2))


def test_a_freed_worker_gets_its_home_shard():
    d = Dispatcher(n_shards=6, max_epochs=2, seed=0)
    d.home = {4: "w1", 2: "w2"}
    _drain_epoch1 = [d.next_shard() for _ in range(6)]
    assert sorted(s for _, s in _drain_epoch1) == list(range(6))
    assert d.next_shard("w2") == (2, 2)
    assert d.next_shard("w1") == (2, 4)
    assert d.next_shard("w3")[1] not in (2, 4)
    assert not d.exhausted()
    _drain(d)
    assert d.exhausted() and d.next_shard() is None


def test_attempts_failures_and_resume():
    d = Dispatcher(n_shards=4, max_epochs=3, seed=0)
    assert [d.next_attempt(1, 2) for _ in range(3)] == [0, 1, 2]
    assert d.last_attempt(1, 2) == 2 and d.last_attempt(1, 3) == 0
    assert d.failed(1, 2) == 1 and d.failed(1, 2, count=False) == 1 and d.failed(1, 2) == 2
    # a resumed run: epoch 1 had shards 0 and 3 merged, epoch 2 shard 1 was uploaded (handled apart)
    r = Dispatcher(n_shards=4, max_epochs=3, seed=0)
    r.restore({1: {0, 3}, 2: set()}, {(1, 0): 1, (1, 3): 2}, last_epoch=2)
    r.take(2, 1)
    assert r.next_attempt(1, 3) == 2  # keys of old attempts are never reused
    handed = _drain(r)
    assert sorted(s for e, s in handed if e == 1) == [1, 2]
    assert sorted(s for e, s in handed if e == 2) == [0, 2, 3]
    assert sorted(s for e, s in handed if e == 3) == [0, 1, 2, 3]


def test_a_resumed_run_hands_out_what_is_left_in_the_order_it_would_have():
    """Each epoch's order comes from the seed and the epoch alone: a run resumed in epoch 2 hands out the rest of
    epoch 2, and every later epoch, as the run it resumes would have (one random stream shifted every later
    order; nothing was trained twice or skipped, but the run was not the run it would have been)."""
    whole = _drain(Dispatcher(n_shards=6, max_epochs=4, seed=3))
    merged = {1: set(range(6)), 2: {s for _, s in whole[6:8]}}  # stopped after 8 merges
    r = Dispatcher(n_shards=6, max_epochs=4, seed=3)
    r.restore(merged, {}, last_epoch=2)
    assert _drain(r) == whole[8:]
    assert Dispatcher(6, 4, seed=3).order(2) != Dispatcher(6, 4, seed=3).order(3)  # (each epoch its own order)


def test_placement_with_no_usable_worker_is_none():
    """Every connected worker excluded or draining: no placement (``workers=[]`` would be no restriction
    to Dask, and the copy would go to the excluded worker); the shard is parked, once, in order."""
    assert Dispatcher.placement("w1", [], 1) is None
    assert Dispatcher.placement(None, [], 0) is None
    assert Dispatcher.placement("w1", [], 2, avoid={"w1"}, busy={"w2"}) is None
    d = Dispatcher(n_shards=4, max_epochs=1, seed=0)
    d.park(1, 2)
    d.park(1, 0)
    d.park(1, 2)
    assert d.returned == [(1, 2), (1, 0)]


def test_placement():
    assert Dispatcher.placement("w1", ["w1", "w2"], 2) == {"workers": ["w1"], "allow_other_workers": True}
    assert Dispatcher.placement(None, ["w1", "w2"], 2) == {}
    assert Dispatcher.placement("w1", ["w1", "w2"], 2, avoid={"w1"}) == {"workers": ["w2"]}  # strict: moved away
    assert Dispatcher.placement("w1", ["w1"], 2) == {"workers": ["w1"]}  # one connected worker is not usable
    # a busy home (its share of copies already there): the copy goes to a worker that is not busy
    assert Dispatcher.placement("w1", ["w1", "w2"], 2, busy={"w1"}) == {"workers": ["w2"], "allow_other_workers": True}
    assert Dispatcher.placement(None, ["w1", "w2", "w3"], 3, busy={"w2"}) == {
        "workers": ["w1", "w3"],
        "allow_other_workers": True,
    }
    assert Dispatcher.placement("w1", ["w1", "w2"], 2, busy={"w1", "w2"}) == {}  # all busy: Dask decides
    assert Dispatcher.placement("w1", ["w1", "w2"], 2, busy={"w2"}) == {"workers": ["w1"], "allow_other_workers": True}
    assert Dispatcher.placement("w1", ["w1", "w2"], 3, busy={"w1"}) == {"workers": ["w1", "w2"]}  # still strict
    assert Dispatcher.placement("w1", ["w1"], 1, avoid={"w1"}) == {"workers": ["w1"], "allow_other_workers": True}
    # workers stuck on a late copy: strict, to the others; if all are stuck, any usable one
    assert Dispatcher.placement("w1", ["w1", "w2", "w3"], 3, avoid={"w1", "w3"}) == {"workers": ["w2"]}
    assert Dispatcher.placement("w1", ["w1", "w2"], 2, avoid={"w1", "w2"}) == {
        "workers": ["w1"],
        "allow_other_workers": True,
    }


def test_pool_usable_slots_exclusion_and_drain():
    pool = WorkerPool(Resilience(max_worker_failures=2), tasks_per_slot=2, connected={"a": 1, "b": 2})
    assert sorted(pool.usable()) == ["a", "b"] and pool.slots() == 6
    pool.finished("a", 1.0)
    pool.finished("b", 3.0)
    assert pool.usable() == ["a", "b"]  # fastest first
    assert pool.fault("a", "timed_out") is None
    assert pool.usable() == ["b", "a"]  # reliable first
    assert pool.fault("a", "rejected") == "0 failed, 1 timed out, 1 rejected (max_worker_failures=2)"
    assert pool.fault("a", "failed") is None  # excluded once, reported once
    assert pool.usable() == ["b"] and pool.slots() == 4
    pool.drain("b")
    assert pool.usable() == [] and pool.slots() == 1
    assert pool.unusable() == {"a": "0 failed, 1 timed out, 1 rejected (max_worker_failures=2)", "b": "draining"}
    assert pool.record("b").preempted
    pool.joined("c", 1)
    assert pool.usable() == ["c"] and pool.cold("c") and not pool.cold(None) and not pool.cold("a")
    pool.left("c")
    assert pool.usable() == []
    assert {r["worker"] for r in pool.rows()} == {"a", "b", "c"}


def test_positions_follow_the_hand_out_order_and_survive_reissue_and_resume():
    """A global learning-rate schedule's clock: each shard's place in the order the run handed them out.
    A re-issued copy keeps its shard's place; a resumed run's merged shards keep theirs taken."""
    d = Dispatcher(n_shards=4, max_epochs=2, seed=3)
    handed = _drain(d)
    assert [d.position(e, s) for e, s in handed] == list(range(8))
    assert d.position(*handed[5]) == 5  # asked again (a re-issue): the same place
    resumed = Dispatcher(n_shards=4, max_epochs=2, seed=3)
    resumed.restore({1: {0, 2, 3}}, {}, last_epoch=1)  # three shards of epoch 1 merged before the stop
    rest = _drain(resumed)
    assert [resumed.position(e, s) for e, s in rest] == [3, 4, 5, 6, 7]


def test_a_fault_forgiven_lifts_the_exclusion_it_caused():
    """A rejection found to be the data's (the shard came back NaN on two workers) is taken back."""
    pool = WorkerPool(Resilience(max_worker_failures=2), tasks_per_slot=1, connected={"a": 1, "b": 1})
    pool.fault("a", "timed_out")
    assert pool.fault("a", "rejected") is not None and pool.usable() == ["b"]
    pool.forgive("a", "rejected")
    assert pool.record("a").rejected == 0 and pool.record("a").excluded is None and sorted(pool.usable()) == ["a", "b"]
    pool.forgive("b", "rejected")  # nothing to take back: never below 0
    assert pool.record("b").rejected == 0


def test_merged_updates_repay_rejections_so_sporadic_ones_never_exclude_an_honest_worker():
    """Robust merging rejects an honest update now and then; over a long run those rejections must not add up
    to an exclusion while the worker's other updates merge.  A worker whose every update is rejected is
    excluded as before, and a failure or a timeout is never repaid."""
    pool = WorkerPool(Resilience(max_worker_failures=3), tasks_per_slot=1, connected={"honest": 1, "hostile": 1})
    for _ in range(10):  # ten rejections, each followed by merged updates
        assert pool.fault("honest", "rejected") is None
        pool.credit("honest")
        pool.credit("honest")  # a second merge finds nothing left to repay
    assert pool.record("honest").rejected == 10 and pool.record("honest").excluded is None  # the total stays
    for _ in range(2):
        assert pool.fault("hostile", "rejected") is None
    assert pool.fault("hostile", "rejected") == "0 failed, 0 timed out, 3 rejected (max_worker_failures=3)"
    pool.credit("hostile")  # a copy already out merges after the exclusion: it stays excluded
    assert pool.usable() == ["honest"]
    pool.fault("honest", "timed_out")
    pool.fault("honest", "failed")
    pool.credit("honest")
    assert pool.fault("honest", "failed") is not None  # failures and timeouts are not repaid
