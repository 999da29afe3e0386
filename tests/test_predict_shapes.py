"""What outputs predict, by their shape against the labels: one logit per label (a binary classifier), scores per class
along axis 1 of a classifier per position (cross_entropy's layout); and predicting with the model as it is now (its
dtype, each layer's mode).  No cluster: the metrics, the pre-flight and the predict path are called directly."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from refusal_helpers import refused
from spec_helpers import predict_spec

BCE_LOGITS = torch.nn.functional.binary_cross_entropy_with_logits


def test_accuracy_of_one_logit_per_label_thresholds_it_at_zero():
    """Float 0/1 labels against one logit each: class 1 above 0.  It was the share of negatives for (n, 1)
    outputs (the arg-max of one column is 0), and an arg-max over the batch for (n,) ones."""
    from vcdask.options import accuracy, mae

    logits = torch.tensor([2.0, -1.0, 0.5, -3.0])
    labels = torch.tensor([1.0, 1.0, 1.0, 0.0])  # predicted 1, 0, 1, 0: 3 of 4 right, 1 negative of 4
    assert accuracy(logits[:, None], labels) == 0.75  # (n, 1) outputs, (n,) labels
    assert accuracy(logits[:, None], labels[:, None]) == 0.75  # (n, 1) against (n, 1)
    assert accuracy(logits, labels) == 0.75  # (n,) against (n,)
    assert accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1])) == 0.5  # scores per class
    assert mae(logits[:, None], labels) == pytest.approx((1 + 2 + 0.5 + 3) / 4)  # a regression's, as before


def test_a_classifier_per_position_reads_its_classes_along_axis_1():
    """Outputs (n, C, T) against labels (n, T): the classes lie along axis 1, as cross_entropy reads them, in
    accuracy, mae, predict and predict_proba alike (they took the last axis, T)."""
    from vcdask.options import accuracy, mae
    from vcdask.predict import predicted, probabilities

    generator = torch.Generator().manual_seed(0)
    out = torch.randn(5, 3, 6, generator=generator)  # C = 3 classes at T = 6 positions
    ids = out.argmax(dim=1)
    labels = ids.clone()
    labels[:, 0] = (ids[:, 0] + 1) % 3  # one position in six wrong
    assert accuracy(out, labels) == pytest.approx(5 / 6)
    assert mae(out, labels) == pytest.approx(float((ids - labels).abs().float().mean()))
    spec = predict_spec(label_shape=(6,))
    np.testing.assert_array_equal(predicted(out, spec), ids.numpy())
    proba = probabilities(out, spec)
    assert proba.shape == (5, 3, 6)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(proba.argmax(axis=1), ids.numpy())
    old = predict_spec(label_shape=None)  # a run recorded before label_shape: a classifier's labels have one axis less
    np.testing.assert_array_equal(predicted(out, old), ids.numpy())
    flat = torch.randn(4, 3, generator=generator)  # (n, C): the last axis, as before
    np.testing.assert_array_equal(predicted(flat, predict_spec()), flat.argmax(dim=-1).numpy())
    # a language model's (n, T, V) outputs against (n, T) labels (its loss flattens them): only the last axis
    # leaves the labels' shape, so it holds the classes
    tokens = torch.randn(5, 4, 7, generator=generator)
    next_ids = tokens.argmax(dim=-1)
    assert accuracy(tokens, next_ids) == 1.0
    np.testing.assert_array_equal(predicted(tokens, predict_spec(label_shape=(4,))), next_ids.numpy())


def test_a_binary_classifier_predicts_class_ids_shaped_as_its_labels_and_their_probabilities():
    """A run on float labels with binary_cross_entropy_with_logits (or BCEWithLogitsLoss) is a classifier of one
    logit per label: predict gives class ids in the labels' shape, predict_proba P(class 0) and P(class 1)."""
    from vcdask.predict import binary_classifier, predicted, probabilities

    logits = torch.tensor([[2.0], [-1.0], [0.0]])
    weighted = functools.partial(BCE_LOGITS, pos_weight=torch.tensor([2.0]))  # (a partial was not seen as one)
    for loss in (BCE_LOGITS, torch.nn.BCEWithLogitsLoss(), weighted, functools.partial(weighted, reduction="sum")):
        spec = predict_spec(classification=False, loss=loss, label_shape=())
        assert binary_classifier(spec)
        ids = predicted(logits, spec)
        assert ids.dtype == np.int64 and ids.tolist() == [1, 0, 0]  # (n,) labels: (n,) ids
        proba = probabilities(logits, spec)
        assert proba.shape == (3, 2)
        np.testing.assert_allclose(proba[:, 1], torch.sigmoid(logits).flatten().numpy(), rtol=1e-6)
        np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-6)
    assert predicted(logits, predict_spec(classification=False, loss=BCE_LOGITS, label_shape=(1,))).tolist() == [
        [1],
        [0],
        [0],
    ]
    several = torch.tensor([[1.0, -1.0], [-2.0, 3.0]])  # two binary labels a sample: the sigmoid of each
    spec = predict_spec(classification=False, loss=BCE_LOGITS, label_shape=(2,))
    assert predicted(several, spec).tolist() == [[1, 0], [0, 1]]
    np.testing.assert_allclose(probabilities(several, spec), torch.sigmoid(several).numpy(), rtol=1e-6)
    regression = predict_spec(classification=False, loss=torch.nn.functional.mse_loss, label_shape=())
    assert not binary_classifier(regression)
    assert predicted(logits, regression).dtype == np.float32  # a regression's outputs, as they are


def test_plan_takes_a_classifier_per_position_whose_positions_outnumber_its_classes(tmp_path):
    """C = 3 classes at T = 6 positions was refused: accuracy's arg-max over the last axis (T) could not be
    compared with the labels; and classes beyond the outputs' are refused naming the class axis."""
    from vcdask.data import DataError
    from vcdask.options import plan

    X = np.random.default_rng(0).normal(size=(40, 2, 6)).astype("float32")
    y = (X[:, 0] > 0).astype("int64") + (X[:, 1] > 0.5).astype("int64")  # classes 0..2, shape (n, 6)
    planned = plan(torch.nn.Conv1d(2, 3, 1), (X, y), store=tmp_path / "s")
    assert planned.metric_names == ("loss", "accuracy")
    with pytest.raises(
        DataError, match=r"outputs 2 classes; labels must be in \[0, 1\] \(the classes lie along axis 1"
    ):
        plan(torch.nn.Conv1d(2, 2, 1), (X, y), store=tmp_path / "s")
    square = plan(torch.nn.Conv1d(2, 6, 1), (X, y), store=tmp_path / "s")  # (n, 6, 6): cross_entropy reads axis 1
    assert square.metric_names == ("loss", "accuracy")

    def flattened(out, target):  # a loss of its own, which may read the last axis: said
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

    with pytest.warns(UserWarning, match=r"the classes of outputs \(n, 6, 6\) against labels \(n, 6\) may lie along"):
        plan(torch.nn.Conv1d(2, 6, 1), (X, y), loss=flattened, store=tmp_path / "s")


def test_accuracy_on_float_labels_needs_a_loss_of_one_logit(tmp_path):
    """accuracy reads float labels' outputs as logits only where the loss trains them as logits: with another
    loss (MSE on 0/1 labels: outputs near probabilities) there is no threshold it can tell, and fit says so."""
    from vcdask.options import plan

    X = np.random.default_rng(1).normal(size=(40, 4)).astype("float32")
    y = (X[:, 0] > 0).astype("float32")[:, None]  # (n, 1), as the loss compares them with (n, 1) outputs
    refused(
        torch.nn.Linear(4, 1),
        (X, y),
        tmp_path,
        ValueError,
        "metric 'accuracy' counts the labels the outputs predict, but the labels are floats",
        "binary_cross_entropy_with_logits",
        "y.astype('int64')",
        metrics=["accuracy"],
    )
    planned = plan(torch.nn.Linear(4, 1), (X, y), loss=BCE_LOGITS, metrics=["accuracy"], store=tmp_path / "s")
    assert planned.metric_names == ("loss", "accuracy")
    weighted = functools.partial(BCE_LOGITS, pos_weight=torch.tensor([3.0]))  # refused: a partial was not seen
    planned = plan(torch.nn.Linear(4, 1), (X, y), loss=weighted, metrics=["accuracy"], store=tmp_path / "s")
    assert planned.metric_names == ("loss", "accuracy")


def test_integer_labels_with_a_last_axis_of_size_1_are_read_as_labels_without_it(tmp_path):
    """Outputs (n, C) against labels (n, 1), with a loss that squeezes them: the outputs were thresholded at 0 and
    compared with the labels broadcast to (n, C), a wrong accuracy, silently (mae failed)."""
    from vcdask.data import DataError
    from vcdask.options import accuracy, mae, plan
    from vcdask.predict import predicted, probabilities

    out = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.2, 0.0], [0.0, 0.1, 0.7], [0.5, 0.0, 0.2]])
    labels = torch.tensor([[1], [1], [2], [2]])  # predicted 1, 0, 2, 0: 2 of 4 right
    assert accuracy(out, labels) == 0.5
    assert mae(out, labels) == pytest.approx((0 + 1 + 0 + 2) / 4)
    spec = predict_spec(label_shape=(1,))
    assert predicted(out, spec).tolist() == [[1], [0], [2], [0]]  # shaped as the labels
    np.testing.assert_allclose(probabilities(out, spec), torch.softmax(out, dim=-1).numpy(), rtol=1e-6)
    per_position = torch.randn(5, 3, 6, generator=torch.Generator().manual_seed(0))  # (n, C, T) against (n, T, 1)
    ids = per_position.argmax(dim=1)
    assert accuracy(per_position, ids[..., None]) == 1.0
    assert predicted(per_position, predict_spec(label_shape=(6, 1))).tolist() == ids[..., None].tolist()

    def squeezed(out, target):
        return torch.nn.functional.cross_entropy(out, target.squeeze(-1))

    X = np.random.default_rng(0).normal(size=(40, 2, 6)).astype("float32")
    y = ((X[:, 0] > 0).astype("int64") + (X[:, 1] > 0.5).astype("int64"))[..., None]  # classes 0..2, (n, 6, 1)
    planned = plan(torch.nn.Conv1d(2, 3, 1), (X, y), loss=squeezed, store=tmp_path / "s")
    assert planned.metric_names == ("loss", "accuracy")
    with pytest.raises(DataError, match=r"outputs 2 classes; labels must be in \[0, 1\]"):  # axis 1's, not T's
        plan(torch.nn.Conv1d(2, 2, 1), (X, y), loss=squeezed, store=tmp_path / "s")


def test_predict_casts_rows_to_the_models_dtype_now(tmp_path):
    """A model cast after the run (to float64, or bfloat16) takes its rows in its own dtype, not the run's float32
    (which failed as 'the model cannot process X'); bfloat16 outputs come back as float32 (numpy has none)."""
    from vcdask.predict import model_outputs

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    rows = np.random.default_rng(2).normal(size=(5, 3)).astype("float32")
    for dtype, out_dtype in ((torch.float64, torch.float64), (torch.bfloat16, torch.float32)):
        model.to(dtype)
        out = model_outputs(model, predict_spec(), rows)
        assert out.dtype == out_dtype
        with torch.no_grad():
            expected = model(torch.from_numpy(rows).to(dtype)).float()
        torch.testing.assert_close(out.float(), expected)
    tokens = torch.nn.Sequential(torch.nn.Embedding(10, 2), torch.nn.Flatten())  # integer rows kept integer
    assert model_outputs(tokens, predict_spec(cast_x=False), np.array([[1, 2], [3, 4]])).shape == (2, 4)


def test_predict_restores_each_layers_mode():
    """A batch norm the user put in eval mode stays in eval mode after predict (the whole model was set to the
    top module's mode); the model runs in eval mode throughout."""
    from vcdask.predict import model_outputs

    seen = []

    class Records(torch.nn.Module):
        def forward(self, x):
            seen.append(self.training)
            return x

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), Records(), torch.nn.Dropout(0.5))
    model.train()
    model[1].eval()
    before = [m.training for m in model.modules()]
    model_outputs(model, predict_spec(), np.ones((6, 3), np.float32), batch_size=4)
    assert [m.training for m in model.modules()] == before == [True, True, False, True, True]
    assert seen == [False, False]


def test_a_model_in_train_mode_keeps_its_frozen_layers_in_eval_mode_as_it_trains():
    """The frozen layers a model holds in eval mode (frozen batch norm: fine-tuning) are recorded by name and kept
    in eval mode by the workers' train_mode; a model wholly in eval mode whose layers all train (from vcdask.load,
    unfrozen) trains in train mode throughout (tests/test_frozen_layers.py: the rule)."""
    from vcdask.steps import eval_modules, train_mode

    def model():
        return torch.nn.Sequential(
            torch.nn.Linear(4, 8),
            torch.nn.Sequential(torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.1)),
            torch.nn.Linear(8, 2),
        )

    frozen = model()
    frozen[1].eval().requires_grad_(False)
    frozen[1][1].train()  # its dropout left on
    names = eval_modules(frozen)
    assert names == ("1.0",)  # (its container holds a layer in train mode: not kept whole)
    copy = model().eval()  # (a fresh copy, wholly in eval mode, as a worker's copy may be)
    train_mode(copy, names)
    assert [m.training for m in copy.modules()] == [True, True, True, False, True, True]
    statistics = copy[1][0].running_mean.clone()
    copy(torch.randn(16, 4))
    assert torch.equal(copy[1][0].running_mean, statistics)  # the frozen statistics do not move
    loaded = model().eval()
    assert eval_modules(loaded) == ()
    assert all(m.training for m in train_mode(loaded, eval_modules(loaded)).modules())


def test_metric_names_that_collide_are_refused_before_any_work(tmp_path):
    """Two metrics of one name (two lambdas), or a name of a column FitResult.epochs has already (the validation
    loss, train_loss, a metric's _min) replaced one number with another; a partial is named by its keywords."""
    import functools

    from vcdask.options import resolve_metrics

    def topk(output, target, k=1):
        return float((output.topk(k, dim=-1).indices == target[:, None]).any(-1).float().mean())

    named = resolve_metrics([functools.partial(topk, k=1), functools.partial(topk, k=2), "accuracy"], True)
    assert list(named) == ["topk(k=1)", "topk(k=2)", "accuracy"]

    class Scorer:
        def __call__(self, output, target):
            return 0.0

    assert list(resolve_metrics([Scorer()], True)) == ["Scorer"]  # (not a repr with its address)
    X = np.random.default_rng(3).normal(size=(40, 4)).astype("float32")
    y = np.arange(40) % 3
    for metrics, fragment in (
        ([lambda *_: 1.0, lambda *_: 2.0], "metrics= names two metrics '<lambda>'"),
        (["accuracy", "accuracy"], "names two metrics 'accuracy'"),
        ({"loss": topk}, "'loss', which would replace the validation loss vcdask reports itself"),
        ({"train_loss": topk}, "'train_loss', which would replace a column of every row of FitResult.epochs"),
        ({"top": topk, "top_max": topk}, "'top_max', which would replace the max of 'top' over an epoch"),
        ({"loss_min": topk}, "'loss_min', which would replace the min of 'loss' over an epoch"),
    ):
        message = refused(torch.nn.Linear(4, 3), (X, y), tmp_path, ValueError, fragment, metrics=metrics)
        assert "name" in message.split(";")[-1]  # what to do


def test_an_eval_steps_names_that_collide_with_the_epochs_columns_are_refused(tmp_path):
    def step(model, batch):
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    def evaluate(model, batch):
        return {"loss": step(model, batch), "epoch": 1.0}

    data = {"x": np.ones((20, 4), np.float32), "y": np.arange(20) % 2}
    refused(
        torch.nn.Linear(4, 2),
        data,
        tmp_path,
        ValueError,
        "eval_step names a metric 'epoch', which would replace a column of every row of FitResult.epochs",
        train_step=step,
        eval_step=evaluate,
    )
