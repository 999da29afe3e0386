"""What a run with a custom step gives back: ``predict`` of a ``train_step`` trained on integer labels that are not
class ids (a count regression) gave class ids read from one output (all 1).  The predict path is called directly;
a real fit on a threaded cluster."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vcdask
from vcdask.predict import predicted, probabilities


def _step(model, batch):  # (a train_step: the fake specs below only need one)
    return model(batch[0]).sum()


def _spec(**fields):
    """The fields of a RunSpec that predict reads: a run with a train_step on integer labels."""
    base = {
        "batch_form": "xy",
        "feature_names": (),
        "classification": True,
        "x_dtype": torch.float32,
        "cast_x": True,
        "loss": F.cross_entropy,
        "label_shape": (),
        "train_step": _step,
    }
    return types.SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize(
    ("out_shape", "label_shape"),
    [((6, 1), ()), ((6,), ()), ((6, 3), (3,)), ((6, 1), (1,))],
    ids=["one-output", "flat-output", "multi-target", "column-labels"],
)
def test_outputs_that_are_not_class_scores_of_a_train_steps_integer_labels_are_refused(out_shape, label_shape):
    """One output against integer counts (predict said 1 for every row), several integer targets (1 for each)."""
    out = torch.randn(out_shape, generator=torch.Generator().manual_seed(0))
    spec = _spec(label_shape=label_shape)
    for read in (predicted, probabilities):
        with pytest.raises(TypeError, match="not scores per class") as caught:
            read(out, spec)
        message = str(caught.value)
        assert "train_step on integer labels" in message and "result.model" in message
        assert "float labels" in message


def test_a_train_steps_class_scores_still_give_class_ids_and_probabilities():
    generator = torch.Generator().manual_seed(0)
    out = torch.randn(6, 3, generator=generator)  # scores per class against labels (n,)
    np.testing.assert_array_equal(predicted(out, _spec()), out.argmax(1).numpy())
    np.testing.assert_allclose(probabilities(out, _spec()).sum(1), 1.0, rtol=1e-6)
    tokens = torch.randn(2, 5, 7, generator=generator)  # a language model: (n, T, V) against (n, T)
    np.testing.assert_array_equal(predicted(tokens, _spec(label_shape=(5,))), tokens.argmax(-1).numpy())


def test_a_spec_that_records_its_labels_range_needs_a_column_beyond_the_largest_id():
    """Two outputs (a count's mean and dispersion) against counts up to 9: not two classes."""
    out = torch.randn(6, 2, generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="class ids up to 9"):
        predicted(out, _spec(label_range=(0, 9)))
    np.testing.assert_array_equal(predicted(out, _spec(label_range=(0, 1))), out.argmax(1).numpy())


def test_the_default_steps_one_logit_classifier_is_unchanged():
    """Without a train_step the pre-flight checked the outputs against the labels: predict reads them as before."""
    logits = torch.tensor([[2.0], [-1.0]])
    spec = _spec(train_step=None, classification=False, loss=F.binary_cross_entropy_with_logits)
    np.testing.assert_array_equal(predicted(logits, spec), [1, 0])


def _counts(n: int = 96) -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(0)
    X = generator.normal(size=(n, 5)).astype("float32")
    return X, generator.poisson(np.exp(0.5 * X[:, 0] + 1.0))


def _poisson_step(model, batch):
    x, y = batch
    return F.poisson_nll_loss(model(x).squeeze(-1), y.float(), log_input=True)


def test_predict_of_a_count_regression_on_integer_labels_says_to_call_the_model(threaded_client, tmp_path):
    """The reviewer's run: predict gave [1 1 1 ...] and predict_proba [[1.], ...]."""
    X, counts = _counts()
    torch.manual_seed(0)
    result = vcdask.fit(
        torch.nn.Linear(5, 1),
        (X, counts),
        train_step=_poisson_step,
        client=threaded_client,
        store=tmp_path / "s",
        max_epochs=1,
        progress=False,
    )
    with pytest.raises(TypeError, match="not scores per class"):
        result.predict(X[:4])
    with pytest.raises(TypeError, match="not scores per class"):
        result.predict_proba(X[:4])
    # the remedy the message gives: float labels, and predict returns the model's outputs
    result = vcdask.fit(
        torch.nn.Linear(5, 1),
        (X, counts.astype("float32")),
        train_step=_poisson_step,
        client=threaded_client,
        store=tmp_path / "t",
        max_epochs=1,
        progress=False,
    )
    with torch.no_grad():
        expected = result.model(torch.as_tensor(X[:4])).numpy()
    np.testing.assert_allclose(result.predict(X[:4]), expected, rtol=1e-6)
