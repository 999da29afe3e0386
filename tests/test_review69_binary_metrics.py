"""A binary classifier of one logit per float 0/1 label (binary_cross_entropy_with_logits, BCEWithLogitsLoss, a
partial of either) was scored by the mae of its raw logits against 0/1: its default metric, followed by early
stopping and best_version.  It is a classifier, as accuracy and predict read it: accuracy by default, and mae / mse
are the errors of its class ids (1 where the logit is above 0)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import vcdask
from vcdask.options import plan


def _data(n, seed):
    X = np.random.default_rng(seed).normal(size=(n, 5)).astype("float32")
    return X, (X[:, :1] > 0).astype("float32")  # (n, 1) float 0/1 labels


def _model(flat=False):
    """The reviewer's Linear(5, 8)-ReLU-Linear(8, 1): outputs (n, 1); ``flat``: (n,), for labels (n,)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)]
    return torch.nn.Sequential(*layers, *([torch.nn.Flatten(0)] if flat else []))


LOGIT_LOSSES = [
    F.binary_cross_entropy_with_logits,
    torch.nn.BCEWithLogitsLoss(),
    functools.partial(F.binary_cross_entropy_with_logits, pos_weight=torch.tensor([2.0])),
]


@pytest.mark.parametrize("loss", LOGIT_LOSSES, ids=["function", "module", "partial"])
def test_a_one_logit_classifier_reports_accuracy_by_default_and_follows_it(loss, tmp_path):
    X, y = _data(300, 0)
    stopping = vcdask.Stopping(patience=2)
    planned = plan(_model(), (X, y), loss=loss, validation=_data(100, 1), stopping=stopping, store=tmp_path / "s")
    assert planned.metric_names == ("loss", "accuracy")
    assert planned.stopping.monitor == "accuracy"  # (early stopping and best_version follow it, upwards)
    # labels and outputs of shape (n,): the same
    flat = plan(_model(flat=True), (X, y[:, 0]), loss=loss, validation=0.2, store=tmp_path / "s")
    assert flat.metric_names == ("loss", "accuracy")


@pytest.mark.parametrize("labels", ["(n, 1)", "(n,)"])
def test_mae_and_mse_of_a_one_logit_classifier_are_those_of_its_class_ids(labels, tmp_path):
    X, y = _data(300, 0)
    y = y if labels == "(n, 1)" else y[:, 0]
    loss = F.binary_cross_entropy_with_logits
    model = _model(flat=labels == "(n,)")
    planned = plan(model, (X, y), loss=loss, metrics=["mae", vcdask.options.mse], store=tmp_path / "s")
    assert planned.metric_names == ("loss", "mae", "mse")  # (vcdask's mse given as a function: the same)
    logits = torch.tensor([[2.5], [-1.3], [0.4], [-0.2]])  # classes 1, 0, 1, 0
    target = torch.tensor([[1.0], [1.0], [0.0], [0.0]])  # two wrong
    target = target if labels == "(n, 1)" else target[:, 0]
    assert planned.metrics["mae"](logits, target) == pytest.approx(0.5)  # (of the logits: 1.2)
    assert planned.metrics["mse"](logits, target) == pytest.approx(0.5)
    assert planned.metrics["mae"](logits, target) == pytest.approx(1 - vcdask.options.accuracy(logits, target))
    # a regression on float labels keeps comparing its outputs
    regression = plan(model, (X, y), metrics=["mae"], store=tmp_path / "s")
    assert regression.metrics["mae"](logits, target) == pytest.approx(
        float((logits.reshape(target.shape) - target).abs().mean())
    )


def test_a_one_logit_run_reports_the_accuracy_and_class_errors_of_its_model(tmp_path):
    """The reviewer's run, end to end: its metrics are accuracy (by default) and the mae of the class ids that
    predict gives, on the validation data."""
    from distributed import Client, LocalCluster

    X, y = _data(300, 0)
    Xv, yv = _data(100, 1)
    kw = dict(max_epochs=3, n_shards=2, lr=0.05, store=tmp_path / "s", progress=False)
    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        loss = F.binary_cross_entropy_with_logits
        result = vcdask.fit(_model(), (X, y), loss=loss, validation=(Xv, yv), patience=2, client=client, **kw)
        assert set(result.metrics) == {"loss", "accuracy"}
        assert "accuracy" in result.epochs.columns and "mae" not in result.epochs.columns
        predicted = result.predict(Xv)
        assert result.metrics["accuracy"] == pytest.approx(float((predicted == yv).mean()))
        scored = vcdask.fit(_model(), (X, y), loss=loss, validation=(Xv, yv), metrics=["mae"], client=client, **kw)
        ids = scored.predict(Xv)
        assert scored.metrics["mae"] == pytest.approx(float(np.abs(ids - yv).mean()))
