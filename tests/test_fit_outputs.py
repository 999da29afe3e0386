"""Runs whose outputs are not one score per class in (n, C): a binary classifier of one logit per label, and a
classifier per position (n, C, T); their validation accuracy and predictions are those of the trained model.  And a
result shown with its live panel in a notebook pickles, deep-copies and dumps with joblib (without the panel)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import vcdask


def _fit(cluster, tmp_path, model, data, validation, **kwargs):
    torch.manual_seed(0)
    kw = dict(max_epochs=2, n_shards=2, lr=0.05, client=cluster[1], store=tmp_path / "store", progress=False)
    return vcdask.fit(model, data, validation=validation, **kw, **kwargs)


def _outputs(model, X):
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(X))


def test_a_binary_classifier_of_one_logit_reports_and_predicts_its_classes(cluster, tmp_path):
    """Float 0/1 labels, Linear(4, 1), binary_cross_entropy_with_logits: accuracy was the share of negatives and
    predict gave the logits; they are the share of labels the logit's sign gets right, and that sign."""
    rng = np.random.default_rng(1)
    X, Xv = rng.normal(size=(200, 4)).astype("float32"), rng.normal(size=(100, 4)).astype("float32")
    w = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    y, yv = (X @ w > 0).astype("float32")[:, None], (Xv @ w > 0).astype("float32")[:, None]
    loss = torch.nn.functional.binary_cross_entropy_with_logits
    result = _fit(cluster, tmp_path, torch.nn.Linear(4, 1), (X, y), (Xv, yv), loss=loss, metrics=["accuracy"])
    logits = _outputs(result.model, Xv)
    right = float(((logits > 0).float() == torch.from_numpy(yv)).float().mean())
    assert result.metrics["accuracy"] == pytest.approx(right)
    assert right > 0.6 and right != pytest.approx(float((yv == 0).mean()))  # (not the share of negatives)
    predicted = result.predict(Xv)
    assert predicted.dtype == np.int64 and predicted.shape == yv.shape
    np.testing.assert_array_equal(predicted, (logits > 0).long().numpy())
    proba = result.predict_proba(Xv)
    assert proba.shape == (100, 2)
    np.testing.assert_allclose(proba[:, 1], torch.sigmoid(logits).flatten().numpy(), rtol=1e-5)
    np.testing.assert_array_equal(proba.argmax(axis=1), predicted.flatten())


def test_a_classifier_per_position_reports_and_predicts_along_its_class_axis(cluster, tmp_path):
    """Conv1d outputs (n, C=3, T=6) against labels (n, 6), the layout cross_entropy trains: the run was refused
    (accuracy took the last axis); its accuracy, predict and predict_proba read the classes along axis 1."""
    rng = np.random.default_rng(3)
    X, Xv = rng.normal(size=(200, 2, 6)).astype("float32"), rng.normal(size=(100, 2, 6)).astype("float32")

    def labels(X):
        return (X[:, 0] > 0).astype("int64") + (X[:, 1] > 0.5).astype("int64")

    result = _fit(cluster, tmp_path, torch.nn.Conv1d(2, 3, 1), (X, labels(X)), (Xv, labels(Xv)))
    scores = _outputs(result.model, Xv)
    ids = scores.argmax(dim=1)
    assert result.metrics["accuracy"] == pytest.approx(float((ids == torch.from_numpy(labels(Xv))).float().mean()))
    np.testing.assert_array_equal(result.predict(Xv), ids.numpy())
    proba = result.predict_proba(Xv)
    assert proba.shape == (100, 3, 6)
    np.testing.assert_allclose(proba, torch.softmax(scores, dim=1).numpy(), rtol=1e-5, atol=1e-6)

    # shown in a notebook, the result holds its live panel (the client, a lock, the kernel's threads): a copy
    # leaves it out, and the rest comes through
    import joblib

    from vcdask.panel import RunPanel

    result.panel = RunPanel(vcdask.attach(result.run_id, cluster[1]), display=False)
    for again in (
        pickle.loads(pickle.dumps(result)),
        copy.deepcopy(result),
        joblib.load(joblib.dump(result, tmp_path / "result.joblib")[0]),
    ):
        assert again.panel is None and result.panel is not None
        assert (again.run_id, again.version, again.metrics) == (result.run_id, result.version, result.metrics)
        np.testing.assert_array_equal(again.predict(Xv), ids.numpy())
