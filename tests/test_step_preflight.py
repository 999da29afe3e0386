"""The pre-flight of a ``train_step`` (``vcdask.steps.check_steps``): mistakes that passed it and then trained wrong
or failed on the cluster are refused before any cluster work, with their cause and remedy: a step over a model
captured from outside (it trained nothing, and the run "succeeded"), a NaN loss on the probe batch (the run failed
minutes later, blaming the worker), a step that adds a submodule (every update rejected as a layout mismatch), a
step that calls ``loss.backward()`` itself and returns the loss detached, and a Lightning-style dict.  Data given
as three arrays, and a dataset of items of different sizes without ``collate_fn``, say what to pass instead."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from refusal_helpers import refused

from vcdask.data import DataError
from vcdask.options import plan


@pytest.fixture
def xy():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 8)).astype("float32")
    return X, (X[:, 0] + X[:, 1] > 0).astype("int64")


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _step(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _plan(model, data, tmp_path, **kwargs):
    return plan(model, data, store=tmp_path / "store", **kwargs)


def test_a_step_over_the_model_captured_from_outside_is_refused_and_leaves_it_no_gradients(xy, tmp_path):
    model = _net()

    def step(m, batch):  # the outer `model`, not the argument: the probe (and the workers' copies) trained nothing
        x, y = batch
        return F.cross_entropy(model(x), y)

    refused(
        model,
        xy,
        tmp_path,
        DataError,
        "train_step's loss does not depend on the model given to train_step",
        "Use the model argument, not a model captured from outside",
        train_step=step,
    )
    assert all(p.grad is None for p in model.parameters())  # (the probe's backward reached it: cleared)


def test_a_step_over_a_submodule_captured_from_outside_is_warned_of_naming_its_parameters(xy, tmp_path):
    model = _net()
    head = model[2]

    def step(m, batch):
        x, y = batch
        return F.cross_entropy(head(m[1](m[0](x))), y)

    with pytest.warns(UserWarning, match=r"gives no gradient to the trainable parameters 2\.weight, 2\.bias") as info:
        _plan(model, xy, tmp_path, train_step=step)
    assert "use the model argument's own" in str(info[0].message)
    assert info[0].filename == __file__  # (the user's line)
    assert head.weight.grad is None


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(_net().requires_grad_(False).append(torch.nn.Linear(2, 2)), id="frozen-backbone"),
        pytest.param(torch.nn.Sequential(torch.nn.Linear(8, 2)), id="plain"),
    ],
)
def test_legitimate_steps_pass_without_a_warning(xy, tmp_path, model):
    def aux(m, batch):  # an extra loss term, an integer label column, the model called twice: all its own
        x, y = batch
        out = m(x)
        return F.cross_entropy(out, y) + 0.01 * m(x * 2).pow(2).mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in (_step, aux):
            _plan(model, xy, tmp_path, train_step=step)


@pytest.mark.parametrize(("scale", "value"), [(float("nan"), "nan"), (float("inf"), "inf")], ids=["nan", "inf"])
def test_a_non_finite_train_loss_on_the_probe_batch_is_refused_naming_it(xy, tmp_path, scale, value):
    refused(
        _net(),
        xy,
        tmp_path,
        DataError,
        f"train_step's loss is {value} on a probe batch of the training data",
        "torch.log(p + eps)",
        train_step=lambda m, batch: _step(m, batch) * scale,
    )


def test_the_default_steps_non_finite_loss_is_refused_naming_the_models_bad_values(xy, tmp_path):
    """The default step too: a model holding a NaN passed the whole pre-flight and the run failed on the cluster
    after ``no_worker_timeout``; a loss that gives NaN on the data likewise."""
    model = _net()
    with torch.no_grad():
        model[2].bias[1] = float("nan")
    refused(model, xy, tmp_path / "a", DataError, "non-finite values (NaN/inf) in ['2.bias']", "initialize them")

    def log_of_negative(out, y):
        return torch.log(out.sum() - out.sum() - 1.0)

    refused(
        _net(),
        xy,
        tmp_path / "b",
        DataError,
        "the loss of the model's outputs is nan",
        "torch.log(p + eps)",
        loss=log_of_negative,
    )


def test_a_step_that_adds_a_submodule_is_refused_naming_it(xy, tmp_path):
    def build(m, batch):  # Keras-style: built on first call, after fit took the model's layout
        if not hasattr(m, "extra"):
            m.extra = torch.nn.Linear(2, 2)
        return F.cross_entropy(m.extra(m(batch[0])), batch[1])

    def reshape(m, batch):
        m[2].bias = torch.nn.Parameter(torch.zeros(1))
        return _step(m, batch)

    refused(
        _net(),
        xy,
        tmp_path,
        DataError,
        "train_step changes the model's parameters or buffers (added extra.weight, extra.bias)",
        "Create every submodule, parameter and buffer in the model before fit",
        train_step=build,
    )
    refused(_net(), xy, tmp_path, DataError, "(changed 2.bias (2,) float32 -> (1,) float32)", train_step=reshape)


@pytest.mark.parametrize("returned", ["detach", "item"])
def test_a_step_that_calls_backward_and_returns_the_loss_detached_is_told_vcdask_does_the_backward(
    xy, tmp_path, returned
):
    def step(m, batch):
        loss = _step(m, batch)
        loss.backward()
        return loss.detach() if returned == "detach" else loss.item()

    refused(
        _net(),
        xy,
        tmp_path,
        DataError,
        "train_step computes gradients itself (loss.backward() in the step)",
        "vcdask does the rest of the step",
        train_step=step,
    )


@pytest.mark.parametrize(
    ("step", "fragments"),
    [
        (lambda m, b: {"loss": _step(m, b), "log": {}}, ["got a dict with keys ['loss', 'log']", "(out['loss'])"]),
        (lambda m, b: (_step(m, b), 1), ["got a tuple of 2", "return the loss tensor alone"]),
        (lambda m, b: _step(m, b).item(), ["got float", "(not loss.item() or float(loss))"]),
        (lambda m, b: _step(m, b).detach(), ["that requires grad", "not loss.detach(), nor under torch.no_grad()"]),
    ],
    ids=["dict", "tuple", "float", "detached"],
)
def test_a_step_that_returns_no_loss_tensor_says_what_to_return(xy, tmp_path, step, fragments):
    refused(_net(), xy, tmp_path, DataError, "train_step must return a scalar loss tensor", *fragments, train_step=step)


def test_three_arrays_as_data_point_to_a_dict_of_arrays(xy, tmp_path):
    X, y = xy
    refused(
        _net(),
        (X[:, :4], X[:, 4:], y),
        tmp_path,
        DataError,
        "data as a sequence must be (X, y), got 3 items",
        "pass a dict of equal-length arrays, {'a': X1, 'b': X2, 'y': y}, with train_step=",
        train_step=_step,
    )


class _Ragged(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.ones(i + 1, dtype=torch.int64), i % 2


def test_items_of_different_sizes_without_a_collate_fn_point_to_a_padding_one(tmp_path):
    message = refused(
        torch.nn.EmbeddingBag(4, 2),
        _Ragged(),
        tmp_path,
        DataError,
        "cannot make a batch of the dataset's first items",
        "need fit(..., collate_fn=fn(items) -> batch) that pads them",
        "pad_sequence",
    )
    assert "equal size" in message

    def pad(items):
        xs, ys = zip(*items, strict=True)
        return torch.nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor(ys)

    _plan(torch.nn.EmbeddingBag(4, 2), _Ragged(), tmp_path, collate_fn=pad)  # (the remedy is taken)
