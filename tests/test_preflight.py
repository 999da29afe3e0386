"""Pre-flight checks: each refusal names the cause and the remedy, before any cluster work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from refusal_helpers import NoCluster
from refusal_helpers import refused as _refused

import vcdask
from vcdask.data import DataError, prepare_data
from vcdask.preflight import check_run


def _net(n_in=8, n_out=2):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(n_in, 16), torch.nn.ReLU(), torch.nn.Linear(16, n_out))


@pytest.fixture
def X():
    return np.random.default_rng(0).random((60, 8), dtype=np.float32)


def test_string_labels_say_classes_need_integer_ids(X, tmp_path):
    y = np.array(["cat", "dog", "bird"] * 20)
    _refused(
        _net(n_out=3),
        (X, y),
        tmp_path,
        DataError,
        "the labels are strings (e.g. 'cat', 'dog', 'bird')",  # the cause
        "integer class ids",
        "pandas.factorize(y)",  # the remedies
        "sklearn.preprocessing.LabelEncoder",
    )


def test_float_labels_on_a_classifier_point_to_regression_or_integer_labels(X, tmp_path):
    y = (X[:, 0] > 0.5).astype(np.float64)  # 0.0 / 1.0: class ids given as floats
    _refused(
        _net(n_out=2),
        (X, y),
        tmp_path,
        DataError,
        "the labels are floats (float64), so vcdask trains a regression with MSE",  # the cause
        "outputs 2 values per sample ((n, 2) against labels (n,))",
        "give integer class ids 0..1 (these labels look like whole numbers: y.astype('int64')",  # remedy 1
        "loss='mse' with a model whose outputs match the labels' shape",  # remedy 2
    )


def test_float_labels_that_are_not_whole_numbers_get_no_astype_hint(X, tmp_path):
    y = X[:, 0].astype(np.float64)
    message = _refused(_net(n_out=2), (X, y), tmp_path, DataError, "trains a regression", "loss='mse'")
    assert "astype" not in message


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_precision_model_points_to_precision(half, X, tmp_path):
    y = (X[:, 0] > 0.5).astype(np.int64)
    model = _net().to(half)
    _refused(
        model,
        (X, y),
        tmp_path,
        ValueError,
        f"the model holds {str(half).removeprefix('torch.')} parameters (0.weight, 0.bias, 2.weight and 1 more)",
        "updates overflow to NaN",  # the cause
        "model.float()",
        "precision='16-mixed'",  # the remedies
        "precision='bf16'",
    )


def test_mse_with_n1_outputs_and_n_labels_is_refused_naming_both_shapes(X, tmp_path):
    y = X.sum(axis=1)  # float (n,) labels
    _refused(
        _net(n_out=1),
        (X, y),
        tmp_path,
        DataError,
        "loss='mse' would compare model outputs of shape (n, 1) with labels of shape (n,)",
        "broadcasting them to (n, n)",  # the cause
        "y.reshape(-1, 1)",  # the remedies
        "torch.nn.Flatten(0)",
        loss="mse",
    )


def test_l1_broadcast_is_refused_too(X, tmp_path):
    _refused(_net(n_out=1), (X, X.sum(axis=1)), tmp_path, DataError, "loss='l1' would compare", loss="l1")


def test_shapes_that_match_pass():
    """The checks refuse only what they should: matching shapes, the default loss, integer labels."""
    X = np.random.default_rng(1).random((20, 8), dtype=np.float32)
    y = X.sum(axis=1)
    check_run(_net(n_out=1), prepare_data((X, y.reshape(-1, 1))), loss="mse")  # (n, 1) against (n, 1)
    check_run(_net(n_out=1), prepare_data((X, y)), loss=None)  # the default MSE reshapes (n, 1) to (n,)
    check_run(_net(n_out=3), prepare_data((X, np.stack([y] * 3, axis=1))), loss=None)  # 3 regression targets
    check_run(_net(n_out=2), prepare_data((X, (y > 4).astype(np.int64))), loss=None)  # classification
    with pytest.raises(DataError, match="would compare"):  # and the same data with the broadcast refused
        check_run(_net(n_out=1), prepare_data((X, y)), loss=torch.nn.functional.mse_loss)


def test_a_model_that_cannot_take_the_data_keeps_its_message(X, tmp_path):
    _refused(torch.nn.Linear(3, 2), (X, X[:, 0]), tmp_path, DataError, "the model cannot process the training data")


def test_float_labels_with_cross_entropy_ask_for_class_ids(X, tmp_path):
    y = (X[:, 0] > 0.5).astype(np.float32)
    _refused(
        _net(n_out=2),
        (X, y),
        tmp_path,
        DataError,
        "loss='cross_entropy' compares outputs with class ids, but the labels are floats (float32, shape (n,)",
        "Give integer class ids (y.astype('int64')",
        loss="cross_entropy",
    )


def _on_accelerator(model):
    """``model`` with its parameters and buffers on the accelerator stand-in (``cuda:0``, refusing CPU
    batches as a CUDA model does: :mod:`vcdask.testing.devices`)."""
    from vcdask.testing.devices import on_accelerator

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(on_accelerator(p.detach().clone())))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, on_accelerator(b))
    return model


@pytest.mark.parametrize("custom_step", [False, True])
def test_a_model_on_a_gpu_is_checked_on_a_cpu_copy(X, tmp_path, custom_step):
    """A model on a GPU passes the pre-run checks: they run it on a CPU copy, as the probe rows are on the
    CPU (they once ran a copy on the model's own device and said it could not take the data).  The caller's
    model stays where it is."""
    model = _on_accelerator(torch.nn.Sequential(_net(), torch.nn.BatchNorm1d(2)))
    with pytest.raises(RuntimeError, match="same device"):  # what the checks ran into
        model(torch.as_tensor(X))
    y = (X[:, 0] > 0.5).astype(np.int64)
    steps = {"train_step": lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])} if custom_step else {}
    with pytest.raises(AssertionError, match="fit touched the cluster"):  # past every check, on to the cluster
        vcdask.fit(model, (X, y), client=NoCluster(), store=tmp_path / "s", progress=False, **steps)
    assert {t.device.type for t in model.state_dict().values()} == {"cuda"}


def test_custom_steps_written_for_the_models_gpu_are_checked_there(X, tmp_path):
    """A step that moves its batch to the model's GPU itself (``.cuda()``) fails on the CPU copy; the checks
    try it once more on a copy on the model's device, as they did before they moved to the CPU.  A step that
    fails there too is refused with its error."""
    from vcdask.testing.devices import on_accelerator

    def cuda_step(m, b):
        if next(m.parameters()).device.type != "cuda":  # what b[0].cuda() against a CPU model raises
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices")
        return torch.nn.functional.cross_entropy(m(on_accelerator(b[0])), on_accelerator(b[1]))

    y = (X[:, 0] > 0.5).astype(np.int64)
    model = _on_accelerator(_net())
    with pytest.raises(AssertionError, match="fit touched the cluster"):
        vcdask.fit(model, (X, y), client=NoCluster(), store=tmp_path / "s", progress=False, train_step=cuda_step)
    _refused(_on_accelerator(_net()), (X, y), tmp_path, DataError, "train_step fails", train_step=lambda _m, _b: 1 / 0)
    _refused(_net(), (X, y), tmp_path, DataError, "same device", train_step=cuda_step)  # a CPU model: no retry


@pytest.mark.parametrize(
    ("loss", "error", "fragments"),
    [
        (
            torch.nn.CrossEntropyLoss(reduction="none"),  # trained on the cluster: "grad can be implicitly created
            DataError,  # only for scalar outputs", on every task
            ["the loss must return one number for the batch", "a tensor of shape (4,) for 4 samples", "'mean'"],
        ),
        (
            lambda out, y: float(torch.nn.functional.cross_entropy(out, y)),  # nothing to backpropagate
            DataError,
            ["returns float for 4 samples"],
        ),
        (  # called as loss(out, y) it made a module of them: a shape message that hid the cause
            torch.nn.CrossEntropyLoss,
            TypeError,
            ["loss=torch.nn.CrossEntropyLoss is a class: pass an instance, loss=torch.nn.CrossEntropyLoss()"],
        ),
    ],
)
def test_a_loss_that_gives_no_scalar_or_is_a_class_is_refused(X, tmp_path, loss, error, fragments):
    y = (X[:, 0] > 0.5).astype(np.int64)
    _refused(_net(), (X, y), tmp_path, error, *fragments, loss=loss)


def test_a_train_step_that_calls_backward_itself_is_refused_saying_vcdask_does_it(X, tmp_path):
    """On the workers the step's own backward freed the graph that vcdask's backward needs: every step failed with
    'Trying to backward through the graph a second time', after the checks had passed."""

    def step(model, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()  # a habit from a hand-written loop
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    def in_place(model, batch):  # a graph that cannot be backpropagated
        h = torch.sigmoid(model(batch[0]))
        loss = h.sum()
        h.mul_(2)  # sigmoid's output, which its backward needs, changed in place
        return loss

    y = (X[:, 0] > 0.5).astype(np.int64)
    _refused(
        _net(),
        (X, y),
        tmp_path,
        DataError,
        "train_step computes gradients itself (loss.backward() in the step)",
        "vcdask does the rest of the step: zero the gradients, backward",
        "clip (clip_grad_norm=) and the optimizer step",
        train_step=step,
    )
    _refused(
        _net(),
        (X, y),
        tmp_path,
        DataError,
        "train_step's loss cannot be backpropagated: RuntimeError",
        train_step=in_place,
    )
