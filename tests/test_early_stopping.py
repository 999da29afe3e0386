"""Early stopping: fit(patience=, monitor=) stops when the validation metric stops improving."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vcdask
from vcdask.engine.events import EventLog
from vcdask.engine.ledger import Ledger
from vcdask.runs import check_early_stopping


class _Scheduler:
    def log_event(self, topic, msg):
        pass


def _run_epochs(ledger, values, name):
    """Merge one shard per epoch and validate its version with ``{name: value}``; the stop reason."""
    for epoch, value in enumerate(values, start=1):
        ledger.record(epoch, 0, 0, "merged", accepted=True, train_loss=1.0, new_version=epoch)
        ledger.note_merged(epoch, 0, seconds=1.0, step=epoch)
        ledger.validate(epoch, {name: value})
        stop = ledger.close_epochs()
        if stop is not None:
            return epoch, stop
    return None, None


@pytest.mark.parametrize(
    ("name", "values", "stops_at", "best"),
    [
        ("loss", [1.0, 0.5, 0.6, 0.5, 0.4], 4, (2, 0.5)),  # 0.5 again is no improvement
        ("accuracy", [0.5, 0.7, 0.9, 0.8, 0.85, 0.95], 5, (3, 0.9)),
        ("loss", [1.0, 0.9, 0.8, 0.7, 0.6], None, (5, 0.6)),  # always improving: never stops
        ("loss", [float("nan"), 1.0, 1.0, 1.0], 4, (2, 1.0)),  # a NaN epoch is never the best
    ],
)
def test_ledger_stops_after_patience_epochs_without_improvement(name, values, stops_at, best):
    ledger = Ledger(1, 10, validated=True, target=None, events=EventLog(_Scheduler(), "r"), patience=2, monitor=name)
    epoch, stop = _run_epochs(ledger, values, name)
    assert epoch == stops_at
    assert ledger.best["epoch"] == best[0] and ledger.best["value"] == best[1]
    if stops_at is not None:
        assert stop == f"early stopping: {name} has not improved for 2 epochs (best {best[1]:.6g} at epoch {best[0]})"


def test_bad_patience_and_monitor_are_refused_before_any_cluster_work(tmp_path):
    X = np.zeros((20, 3), "float32")
    y = np.arange(20) % 2
    model = torch.nn.Linear(3, 2)
    for bad in (0, -1, 1.5, "3", True):
        with pytest.raises((ValueError, TypeError), match="patience"):
            vcdask.fit(model, (X, y), patience=bad, store=tmp_path / "s")
    with pytest.raises(ValueError, match=r"monitor='f1' is not a validation metric.*\['loss', 'accuracy'\]"):
        vcdask.fit(model, (X, y), patience=2, monitor="f1", store=tmp_path / "s")
    with pytest.raises(TypeError, match="monitor must be"):
        check_early_stopping(2, 3, None, ["accuracy"], validated=True)
    # defaults: the target's metric, else the first metric, else the loss; none without validation
    assert check_early_stopping(2, None, {"loss": 0.1}, ["loss", "accuracy"], True) == (2, "loss")
    assert check_early_stopping(2, None, None, ["loss", "accuracy"], True) == (2, "accuracy")
    assert check_early_stopping(None, None, None, ["loss"], True) == (None, "loss")
    assert check_early_stopping(3, None, None, ["loss", "mae"], False) == (3, None)
    # monitor alone (no patience) holds nothing out: it needs validation data, and says so
    with pytest.raises(ValueError, match=r"monitor='loss'.*no validation data: pass validation="):
        vcdask.fit(model, (X, y), monitor="loss", store=tmp_path / "s")


@pytest.mark.parametrize(
    ("name", "lower"),
    [
        ("loss", True),
        ("val_loss", True),
        ("logloss", True),
        ("mse", True),
        ("rmse", True),
        ("val_mae", True),
        ("error", True),
        ("top1_error", True),
        ("accuracy", False),
        ("f1", False),
        ("r2", False),
        ("auc", False),
    ],
)
def test_one_rule_says_which_metrics_improve_downwards(name, lower):
    """engine.policy.lower_is_better is the rule for targets, early stopping, best_version and plots."""
    from vcdask.engine import policy

    assert policy.lower_is_better(name) is lower
    assert policy.improved(name, 0.4, 0.5) is lower and policy.reached(name, 0.5, 0.4) is lower
    ledger = Ledger(1, 5, validated=True, target=None, events=EventLog(_Scheduler(), "r"), patience=1, monitor=name)
    values = [0.5, 0.4] if lower else [0.4, 0.5]  # epoch 2 improves: no stop yet
    assert _run_epochs(ledger, values, name) == (None, None) and ledger.best["epoch"] == 2


def test_fit_stops_at_the_epoch_the_metric_stopped_improving(tmp_path):
    """Epoch 1 trains; from epoch 2 the learning rate is 0 and the rule replaces W_s by W_c, which equals
    the version its task started from: every later version is the initial one or epoch 1's, so the
    validation loss of epochs 2, 3, ... is never below epoch 1's (epochs overlap: a task of epoch 2 may
    start before epoch 1's shard is merged).  With patience=2 the run ends with epoch 3.

    One worker thread runs the tasks in the order they were sent, so epoch 1's shard merges first: on two
    workers a cold one may merge it after every later epoch, and each row is then that last version
    (an epoch's row waits for the earlier epochs' shards), with nothing for patience to judge."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        _stops_at_epoch_3(client, tmp_path)


def _stops_at_epoch_3(client, tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 6)).astype("float32")
    y = (X[:, 0] - X[:, 2] > 0).astype("int64")
    torch.manual_seed(0)
    result = vcdask.fit(
        torch.nn.Linear(6, 2),
        (X, y),
        validation=0.25,
        max_epochs=10,
        n_shards=1,
        lr=0.05,
        lr_schedule=lambda epoch, _step: 1.0 if epoch == 1 else 0.0,
        merge="vc-asgd",
        alpha=0.0,
        patience=2,
        monitor="loss",
        client=client,
        store=tmp_path / "store",
        progress=False,
    )
    assert list(result.epochs.index) == [1, 2, 3]  # epoch 1 is the best; 2 and 3 do not improve on it
    assert result.stop_reason.startswith("early stopping: loss has not improved for 2 epochs")
    assert "at epoch 1)" in result.stop_reason
    versions = {v.id: v.metadata["step"] for v in result.store.versions(result.run_id)}
    assert versions[result.best_version] == result.epochs.loc[1, "version"]  # the step epoch 1 ended at
    assert result.version != result.best_version  # the result holds the last version
    from vcdask.engine.end import read_record

    record = read_record(result.store, result.run_id)  # what `vcdask runs` lists: stopped early, by patience
    assert (record["status"], record["stop_kind"], record["epochs_done"]) == ("stopped", "patience", 3)
    assert record["best_version"] == result.best_version and record["stop_reason"] == result.stop_reason
    assert result.epochs["loss"].iloc[1:].min() >= result.epochs.loc[1, "loss"]
    initial = vcdask.load(result.store, version=result.store.versions(result.run_id)[-1].id)
    assert initial.vcdask_version["step"] == 0  # training in epoch 1 helped: its loss is below the start's
    with torch.no_grad():
        start_loss = torch.nn.functional.cross_entropy(initial(torch.from_numpy(X)), torch.from_numpy(y))
    assert float(start_loss) > result.epochs.loc[1, "loss"]


def test_patience_counts_from_a_resume():
    """A resumed run re-reads its finished epochs: they do not stop it again at once."""
    ledger = Ledger(1, 10, validated=True, target=None, events=EventLog(_Scheduler(), "r"), patience=2, monitor="loss")
    ledger.resumed_at = 4  # epochs 1-4 were done before (best at epoch 2)
    epoch, stop = _run_epochs(ledger, [1.0, 0.5, 0.6, 0.7, 0.8, 0.9], "loss")
    assert epoch == 6 and ledger.best["epoch"] == 2  # not at epoch 4: two epochs after the resume
    assert stop.endswith("(best 0.5 at epoch 2)")


def test_one_place_decides_the_hold_out_for_fit_and_jobs():
    """``vcdask.holdout.hold_out`` (called by ``plan_run``, which ``fit`` and ``vcdask train`` both use):
    validation as given, else 10% for a target or for early stopping, and a monitor alone is refused."""
    from vcdask.holdout import HOLD_OUT, hold_out

    assert hold_out(None, target=None, patience=None, monitor=None) is None  # as Keras and scikit-learn
    assert hold_out(0.3, target={"accuracy": 0.9}, patience=2, monitor=None) == 0.3
    assert hold_out(None, target={"accuracy": 0.9}, patience=None, monitor=None) == HOLD_OUT == 0.1
    assert hold_out(None, target=None, patience=2, monitor="accuracy") == HOLD_OUT
    with pytest.raises(ValueError, match=r"monitor='accuracy' follows a validation metric, but this fit has no"):
        hold_out(None, target=None, patience=None, monitor="accuracy")
    with pytest.raises(TypeError, match="patience must be an integer >= 1"):
        hold_out(0.2, target=None, patience="2", monitor=None)
