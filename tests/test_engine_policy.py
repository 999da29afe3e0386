"""The engine's decisions (vcdask.engine.policy) as pure functions: no cluster, no store."""

from __future__ import annotations

import math

import pytest
import torch

from vcdask import Resilience
from vcdask.engine import policy
from vcdask.engine.policy import Overdue
from vcdask.params import flatten


def test_deadline_explicit_derived_cold_and_first():
    assert policy.deadline(Resilience(deadline=7), [100.0], 2) == 7.0  # explicit: every task, even cold
    assert policy.deadline(Resilience(deadline=7), [], 2, cold=True) == 7.0
    res = Resilience()  # factor 4, floor 5
    assert policy.deadline(res, [], 2) == policy.FIRST_SHARDS_SECONDS  # nothing measured yet
    assert policy.deadline(res, [1.0, 3.0, 2.0], 2) == 4 * 2 * 2.0  # factor x tasks_per_slot x median
    assert policy.deadline(res, [0.1], 2) == 5.0  # the floor
    assert policy.deadline(res, [0.1], 2, cold=True) == policy.COLD_START_SECONDS
    assert policy.deadline(res, [10.0], 2, cold=True) == 80.0  # a long derived deadline stays


def test_measured_times_keep_their_median_and_total_as_they_come_in():
    """The ledger's shard and validation times give their median and total without sorting or summing them
    again: a long run derives deadlines from them several times a second on the scheduler's loop."""
    import random
    import statistics

    from vcdask.engine.durations import Durations

    rng = random.Random(0)
    times, plain = Durations(), []
    for n in range(1, 202):
        value = rng.choice([rng.random(), 2.0, 0.5])  # (ties too)
        times.append(value)
        plain.append(value)
        assert times.median() == statistics.median(plain) and len(times) == n
        assert math.isclose(times.total, math.fsum(plain))
    assert times == plain and list(times) == plain and times[-64:] == plain[-64:] and times[3] == plain[3]
    assert policy.deadline(Resilience(), times, 2) == policy.deadline(Resilience(), plain, 2)
    assert policy.validation_due("auto", 9, times[:2], times) == policy.validation_due("auto", 9, plain[:2], plain)
    with pytest.raises(statistics.StatisticsError):
        Durations().median()


def test_base_wait_is_one_recent_shard_time_bounded():
    assert policy.base_wait([]) == policy.BASE_WAIT_FIRST  # nothing measured yet
    assert policy.base_wait([2.0, 4.0, 3.0]) == 3.0  # the median shard time
    assert policy.base_wait([0.01, 0.02]) == policy.BASE_WAIT_MIN  # a merge may take longer than tiny tasks
    assert policy.base_wait([100.0] * 3) == policy.BASE_WAIT_MAX
    assert policy.base_wait([9.0] * 100 + [1.0] * 64) == 1.0  # the recent shards (the pace changes)


def test_staleness_limit():
    assert policy.staleness_limit("auto", n_shards=8, in_flight=6) == 24
    assert policy.staleness_limit("auto", n_shards=50, in_flight=4) == 100
    assert policy.staleness_limit(3, n_shards=50, in_flight=4) == 3
    assert policy.staleness_limit(None, n_shards=50, in_flight=4) is None
    with pytest.raises(ValueError, match="'often'"):
        policy.staleness_limit("often", n_shards=1, in_flight=1)


def _overdue(**kw):
    args = dict(
        now=100.0,
        submitted=90.0,
        started=95.0,
        running_on="w1",
        worker="w1",
        behind=0,
        stale_after=10,
        limit=10.0,
        patience=40.0,
    )
    args.update(kw)
    return policy.overdue(**args)


def test_overdue_verdicts():
    assert _overdue() is None  # running 5 s of 10
    assert _overdue(started=85.0) == Overdue("ran past its 10.0 s deadline", blame=True)
    assert _overdue(started=85.0, running_on="w2") == "restart"  # its worker died, Dask moved it
    assert _overdue(started=85.0, running_on=None) == "restart"
    # a copy let finish on a worker under a preemption notice: the notice's window bounds it, not the deadline
    assert _overdue(started=85.0, draining=True) is None
    assert _overdue(started=85.0, running_on="w2", draining=True) == "restart"
    assert _overdue(started=85.0, behind=11, draining=True) == Overdue(
        "fell 11 merges behind (max_staleness=10)", blame=False
    )
    assert _overdue(behind=11) == Overdue("fell 11 merges behind (max_staleness=10)", blame=False)
    assert _overdue(behind=11, stale_after=None) is None  # no limit
    assert _overdue(started=None, submitted=50.0) == Overdue("never started")
    assert _overdue(started=None, submitted=70.0) is None  # queued 30 s of a 40 s patience
    # staleness is checked first: a stale copy is re-issued without blame even when it is also late
    assert _overdue(started=0.0, behind=99).blame is False


def test_after_failure_and_exclusion():
    stop, skip = Resilience(max_attempts=3), Resilience(max_attempts=3, on_shard_failure="skip")
    assert [policy.after_failure(n, stop) for n in (0, 1, 2, 3, 4)] == ["retry", "retry", "retry", "stop", "stop"]
    assert policy.after_failure(3, skip) == "skip"
    res = Resilience(max_worker_failures=3)
    assert policy.exclusion(1, 0, 1, res) is None
    assert policy.exclusion(1, 1, 1, res) == "1 failed, 1 timed out, 1 rejected (max_worker_failures=3)"


@pytest.mark.parametrize(
    ("name", "goal", "value", "expected"),
    [
        ("accuracy", 0.9, 0.95, True),
        ("accuracy", 0.9, 0.85, False),
        ("loss", 0.5, 0.4, True),
        ("loss", 0.5, 0.6, False),
        ("mae", 1.0, 0.5, True),
        ("val_error", 0.1, 0.2, False),
        ("accuracy", 0.9, None, False),
    ],
)
def test_reached(name, goal, value, expected):
    assert policy.reached(name, goal, value) is expected


def test_check_update_kinds():
    server = flatten({"w": torch.zeros(3), "n": torch.tensor(1)})
    ok = flatten({"w": torch.ones(3), "n": torch.tensor(2)})
    assert policy.check_update(server, ok, staleness=5, max_staleness=5, max_norm=2.0) is None
    kind, reason = policy.check_update(
        server, flatten({"w": torch.ones(4), "n": torch.tensor(2)}), staleness=0, max_staleness=None, max_norm=None
    )
    assert kind == "layout" and reason.startswith("layout mismatch: ")
    nan = flatten({"w": torch.tensor([0.0, float("nan"), 0.0]), "n": torch.tensor(2)})
    assert policy.check_update(server, nan, staleness=0, max_staleness=None, max_norm=None) == (
        "non-finite",
        "non-finite values (NaN/inf) in ['w']",
    )
    assert policy.check_update(server, ok, staleness=6, max_staleness=5, max_norm=None) == (
        "stale",
        "stale: based on a version 6 merges old (max_staleness=5)",
    )
    kind, reason = policy.check_update(server, ok, staleness=0, max_staleness=None, max_norm=1.0)
    assert kind == "norm" and reason == "update norm ||W_c - W_s|| = 1.732 > max_update_norm=1"


@pytest.mark.parametrize(
    ("values", "finite"),
    [
        ([0.0, 1.0, -2.0], True),
        ([3e38, 3e38, -1.0], True),  # finite values whose float32 sum overflows: checked one by one
        ([0.0, float("nan")], False),
        ([float("inf"), 1.0], False),
        ([float("inf"), float("-inf")], False),  # their sum is NaN
        ([3e38, 3e38, float("-inf")], False),
    ],
)
def test_check_update_finds_every_non_finite_value(values, finite):
    server = flatten({"w": torch.zeros(len(values))})
    client = flatten({"w": torch.tensor(values, dtype=torch.float32)})
    verdict = policy.check_update(server, client, staleness=0, max_staleness=None, max_norm=None)
    assert (verdict is None) == finite, verdict


def test_work_fraction_sizes_tasks_to_speed():
    assert policy.work_fraction(float("nan"), 0.01) == 1.0  # not measured yet: a whole shard
    assert policy.work_fraction(0.01, 0.01) == 1.0  # the fastest
    assert policy.work_fraction(0.011, 0.01) == 1.0  # within timing noise of it
    assert policy.work_fraction(0.02, 0.01) == pytest.approx(0.5)  # 2x slower: half its shard
    assert policy.work_fraction(0.05, 0.01) == pytest.approx(0.2)
    assert policy.work_fraction(1.0, 0.01) == policy.MIN_WORK_FRACTION  # never less than a tenth


def test_pool_measures_step_seconds_and_gives_fractions():
    from vcdask.engine.pool import SPEED_WEIGHT, WorkerPool

    pool = WorkerPool(Resilience(), tasks_per_slot=2, connected={"fast": 1, "slow": 1, "new": 1})
    pool.finished("fast", 1.0, step_seconds=0.01)
    pool.finished("slow", 3.0, step_seconds=0.05)
    assert pool.work_fraction("fast") == 1.0
    assert pool.work_fraction("slow") == pytest.approx(0.2)
    assert pool.work_fraction("new") == 1.0  # nothing measured: a whole shard
    pool.finished("slow", 1.0, step_seconds=0.02)  # the average moves towards it
    expected = (1 - SPEED_WEIGHT) * 0.05 + SPEED_WEIGHT * 0.02
    assert pool.records["slow"].step_seconds == pytest.approx(expected)
    pool.finished("slow", 1.0, step_seconds=None)  # a task that trained no step changes nothing
    assert pool.records["slow"].step_seconds == pytest.approx(expected)
    pool.left("fast")  # the fastest left: the slow worker is now the fastest one
    assert pool.work_fraction("slow") == 1.0


def test_auto_validation_keeps_validating_within_its_share_of_the_shard_tasks_time():
    assert policy.validation_due(3, 6, [], []) and not policy.validation_due(3, 7, [100.0], [1.0])  # every 3rd
    share = policy.VALIDATION_SHARE
    shards = [1.0] * int(round(2 / share))  # shard tasks long enough for two validations of 1 s
    assert not policy.validation_due("auto", 1, [], [])  # nothing merged yet
    assert not policy.validation_due("auto", 1, [], [1.0])  # before any came back, one costs a shard's time
    assert policy.validation_due("auto", 41, [1.0], shards)  # one more fits
    assert not policy.validation_due("auto", 41, [1.0, 1.2], shards)  # (the epochs' ends count too)
    assert policy.validation_due("auto", 62, [1.0, 1.2], [*shards, *[1.0] * 30])  # the shards caught up


def test_a_run_with_validate_every_auto_spends_its_share_of_the_task_time_validating():
    """Replayed: 1.4 s shard tasks, 0.5 s validations (the char-LM of benchmarks/utilization.py on one
    worker): validating every merge would take a third of the workers' time; "auto" its share."""
    shards: list[float] = []
    validations: list[float] = []
    for step in range(1, 201):
        shards.append(1.4)
        if policy.validation_due("auto", step, validations, shards):
            validations.append(0.5)
    assert sum(validations) <= policy.VALIDATION_SHARE * sum(shards)
    assert len(validations) >= 0.9 * policy.VALIDATION_SHARE * sum(shards) / 0.5 - 1
