"""The run's ledger (vcdask.engine.ledger) and event contract: epochs, validations, target, history rows."""

from __future__ import annotations

import math

import pytest

from vcdask.engine.durations import Durations
from vcdask.engine.events import EVENT_KINDS, OUTCOMES, SHARD_STATES, EventLog, is_train_key, topic, train_key
from vcdask.engine.ledger import Ledger
from vcdask.result import HISTORY_COLUMNS


class _Scheduler:
    """What EventLog needs of a scheduler: log_event (the events it got, in order)."""

    def __init__(self):
        self.events = []

    def log_event(self, topic, msg):
        self.events.append((topic, msg))


def _ledger(n_shards=3, validated=False, target=None):
    sched = _Scheduler()
    t = iter(range(100))
    return Ledger(
        n_shards, 5, validated=validated, target=target, events=EventLog(sched, "r1"), clock=lambda: float(next(t))
    ), sched


def test_epoch_closes_when_its_shards_are_merged_or_skipped():
    led, sched = _ledger()
    assert led.remaining(1) == 3 and not led.completes(1, 0)
    led.record(1, 0, 0, "merged", accepted=True, train_loss=1.0, new_version=1)
    assert led.note_merged(1, 0, seconds=2.0, step=1) is False
    led.record(1, 1, 0, "merged", accepted=True, train_loss=3.0, new_version=2)
    led.note_merged(1, 1, seconds=4.0, step=2)
    assert led.done(1, 1) and not led.done(1, 2) and led.completes(1, 2) and not led.completes(1, 1)
    assert led.close_epochs() is None and led.epochs == []
    assert led.skip(1, 2, step=2) is True  # the last shard skipped: the epoch is complete
    assert led.close_epochs() is None
    (row,) = led.epochs
    assert row["epoch"] == 1 and row["version"] == 2 and row["skipped"] == 1 and row["train_loss"] == 2.0
    assert led.shard_seconds == [2.0, 4.0] and led.shard_seconds.median() == 3.0  # (kept sorted: a long run's
    assert isinstance(led.validation_seconds, Durations)  # deadlines read them several times a second)
    kinds = [m["type"] for t, m in sched.events]
    assert kinds == ["shard", "shard", "shard", "epoch"] and {t for t, _ in sched.events} == {topic("r1")}
    assert [m["state"] for _, m in sched.events[:3]] == ["merged", "merged", "skipped"]


def test_a_shard_merged_after_it_was_given_up_counts_merged_once_and_ends_its_epoch_once():
    """A copy's merge cannot be taken back: a skip of its shard meanwhile gives way to it, and the epoch
    that the skip ended is not ended again (nor counted short)."""
    led, sched = _ledger(n_shards=2)
    led.note_merged(1, 0, seconds=2.0, step=1)
    assert led.skip(1, 1, step=1) is True and led.epoch_end[1] == (1, 0.0)
    assert led.note_merged(1, 1, seconds=3.0, step=2) is False  # the skip ended the epoch already
    assert led.merged == {1: {0, 1}} and led.skipped == {1: set()} and led.remaining(1) == 0
    assert led.epoch_end[1] == (1, 0.0) and led.shard_state[(1, 1)] == "merged"
    assert led.note_merged(2, 0, seconds=math.nan, step=3) is False  # a time nobody measured is not a time
    assert led.shard_seconds == [2.0, 3.0]


def test_an_epoch_a_skip_ends_at_a_later_version_has_its_end_value_within_its_band():
    """Shard 1 of epoch 1 is given up after shard 0 of epoch 2 merged (step 2): the epoch ends at step 2,
    whose value is the row's, and the band holds it beside step 1's (the version of the epoch's merge)."""
    led, sched = _ledger(n_shards=2, validated=True)
    led.record(1, 0, 0, "merged", accepted=True, train_loss=0.5, new_version=1)
    led.note_merged(1, 0, 1.0, step=1)
    led.validate(1, {"loss": 0.7})
    led.record(2, 0, 0, "merged", accepted=True, train_loss=0.4, new_version=2)
    led.note_merged(2, 0, 1.0, step=2)
    assert led.skip(1, 1, step=2, why="shard 1 of epoch 1 failed 3 times") is True
    assert sched.events[-1][1]["state"] == "skipped" and sched.events[-1][1]["why"].endswith("3 times")
    led.validate(2, {"loss": 0.6})
    led.close_epochs()
    [row] = led.epochs
    assert row["version"] == 2 and row["loss"] == 0.6 and row["skipped"] == 1
    assert (row["loss_min"], row["loss_max"]) == (0.6, 0.7) and row["loss_mean"] == pytest.approx(0.65)


def test_validated_epochs_wait_for_their_numbers_and_stop_at_the_target():
    led, _ = _ledger(n_shards=1, validated=True, target={"accuracy": 0.9})
    led.record(1, 0, 0, "merged", accepted=True, train_loss=0.5, new_version=1)
    assert led.note_merged(1, 0, 1.0, step=1) is True  # the only shard: it completes the epoch
    assert led.close_epochs() is None and not led.epochs  # waits for the validation of step 1
    led.validate(1, {"accuracy": 0.8, "loss": 0.6})
    assert led.close_epochs() is None and led.epochs[0]["accuracy"] == 0.8
    led.record(2, 0, 0, "merged", accepted=True, train_loss=0.4, new_version=2)
    led.note_merged(2, 0, 1.0, step=2)
    led.validate(2, {"accuracy": 0.95, "loss": 0.3})
    assert led.close_epochs() == "target {'accuracy': 0.9} reached at epoch 2"
    assert led.epochs[1]["accuracy_min"] == led.epochs[1]["accuracy_max"] == 0.95


def test_an_epoch_held_back_by_a_late_shard_of_an_earlier_one_is_the_version_that_ended_that():
    """Epochs are dispatched without a barrier: a cold worker's shard of epoch 1 merges last (step 4),
    after epochs 2 and 3 ended (steps 2 and 3).  Each row is the model after that many passes: epochs 2
    and 3 are step 4 too (not steps 2 and 3, which miss epoch 1's shard), the versions never go back,
    and rows that bring no new version are no evidence for patience: the run stops by patience only
    after epoch 4's and 5's versions do not improve on step 4."""
    sched = _Scheduler()
    led = Ledger(2, 9, validated=True, target=None, events=EventLog(sched, "r1"), patience=2, monitor="loss")
    merges = [(1, 0, 1), (2, 0, 2), (2, 1, 2), (3, 0, 3), (3, 1, 3), (1, 1, 4), (4, 0, 5), (4, 1, 5)]
    for epoch, shard, step in merges:
        led.record(epoch, shard, 0, "merged", accepted=True, train_loss=float(step), new_version=step)
        led.note_merged(epoch, shard, 1.0, step=step)
    losses = {1: 0.9, 2: 0.5, 3: 0.4, 4: 0.3, 5: 0.35}
    for step in (2, 3, 1):  # (epoch 1's end, step 4, is not validated yet: nothing can close)
        led.validate(step, {"loss": losses[step]})
        assert led.close_epochs() is None and led.epochs == []
    led.validate(4, {"loss": losses[4]})
    led.validate(5, {"loss": losses[5]})
    assert led.close_epochs() is None  # epochs 1-3 at step 4 (the best), epoch 4 at step 5: one newer version
    assert [(r["epoch"], r["version"], r["loss"]) for r in led.epochs] == [
        (1, 4, 0.3),
        (2, 4, 0.3),
        (3, 4, 0.3),
        (4, 5, 0.35),
    ]
    assert [r["wall_time"] for r in led.epochs[:3]] == [led.epoch_end[1][1]] * 3  # (the time step 4 came)
    assert led.epochs[1]["train_loss"] == 2.0 and led.best == {"epoch": 1, "step": 4, "value": 0.3}
    for shard in (0, 1):
        led.record(5, shard, 0, "merged", accepted=True, train_loss=6.0, new_version=6)
        led.note_merged(5, shard, 1.0, step=6)
    led.validate(6, {"loss": 0.31})
    assert led.close_epochs() == "early stopping: loss has not improved for 2 epochs (best 0.3 at epoch 1)"


def test_a_version_validated_twice_keeps_its_first_numbers_and_both_times():
    """A late validation run again elsewhere can come back twice: the first result counts, one event is
    published, and both durations feed the validations' deadline."""
    led, sched = _ledger(n_shards=1, validated=True)
    led.validate(1, {"accuracy": 0.8}, seconds=0.5)
    led.validate(1, {"accuracy": 0.7}, seconds=9.0)
    assert led.validations == {1: {"accuracy": 0.8}}
    assert led.validation_seconds == [0.5, 9.0]
    published = [m for _, m in sched.events if m["type"] == "validation"]
    assert [(m["step"], m["metrics"]) for m in published] == [(1, {"accuracy": 0.8})]


def test_shard_states_are_final_and_rejections_stay_visible():
    led, sched = _ledger()
    led.set_shard(1, 0, "queued")
    led.set_shard(1, 0, "rejected")
    led.set_shard(1, 0, "re-issued")  # a rejection stays until a copy is merged
    assert led.shard_state[(1, 0)] == "rejected"
    led.set_shard(1, 0, "merged")
    led.set_shard(1, 0, "running")  # merged is final
    assert led.shard_state[(1, 0)] == "merged"
    assert [m["state"] for _, m in sched.events] == ["queued", "rejected", "merged"]


def test_history_rows_have_every_column_and_a_typed_outcome():
    led, _ = _ledger()
    row = led.record(1, 2, 0, "late", reason="late: (epoch, shard) already merged from a re-issued copy")
    assert set(row) == set(HISTORY_COLUMNS) and row["outcome"] == "late" and row["time"] == 0.0
    assert led.record(1, 2, 1, "merged", time=42.0)["time"] == 42.0  # the time a result arrived, when given
    assert math.isnan(row["train_loss"]) and row["accepted"] is False


def test_event_contract():
    assert set(OUTCOMES) >= {"merged", "rejected", "duplicate", "late", "lost", "cancelled", "skipped", "store fault"}
    assert SHARD_STATES == ("queued", "running", "re-issued", "merged", "rejected", "skipped")
    assert is_train_key(train_key("run-x", 2, 3, 1)) and train_key("run-x", 2, 3, 1) == "vcdask-train-run-x-e2-s3-a1"
    log = EventLog(_Scheduler(), "r")
    with pytest.raises(ValueError, match=r"unknown event kind 'merge'; valid kinds: \['started'"):
        log.emit("merge")  # type: ignore[arg-type]
    assert "update" in EVENT_KINDS


def test_a_resumed_runs_target_counts_from_the_epochs_it_trains():
    """``resume(max_epochs=N)`` of a run that stopped at its target: the restored epoch reached it, and the
    run stopped again at once, training nothing; the target counts from the resume, as patience does."""
    led, _ = _ledger(n_shards=1, validated=True, target={"accuracy": 0.9})
    led.resumed_at = 1  # (epoch 1 ended before the restart; the store's versions say so)
    led.epoch_end[1] = (1, math.nan)
    led.validate(1, {"accuracy": 0.95})
    assert led.close_epochs() is None and led.epochs[0]["accuracy"] == 0.95
    led.record(2, 0, 0, "merged", accepted=True, train_loss=0.4, new_version=2)
    led.note_merged(2, 0, 1.0, step=2)
    led.validate(2, {"accuracy": 0.96})
    assert led.close_epochs() == "target {'accuracy': 0.9} reached at epoch 2"
