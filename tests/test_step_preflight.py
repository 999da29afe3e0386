"""The pre-flight of a ``train_step`` (``vcdask.steps.check_steps``): mistakes that passed it and then trained wrong
or failed on the cluster are refused before any cluster work, with their cause and remedy: a step over a model
captured from outside (it trained nothing, and the run "succeeded"), a NaN loss on the probe batch and on more rows
spread over the data (the run failed minutes later, blaming the worker), a step that adds a submodule (every update
rejected as a layout mismatch), a step that calls ``loss.backward()`` itself and returns the loss detached, and a
Lightning-style dict.  Data given as three arrays, and a dataset of items of different sizes without
``collate_fn``, say what to pass instead.

Legitimate steps pass without a warning: a masked loss that is NaN on the first rows only (none labelled), and
models some of whose trainable parameters get no gradient on a batch (unrouted experts, dropped layers, a head
only ``eval_step`` uses, a teacher under ``torch.no_grad()``)."""

from __future__ import annotations

import warnings

import dask.array as da
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import xarray as xr
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


class _MoE(torch.nn.Module):  # top-1 routing: the experts no row of a batch is routed to get no gradient
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 2) for _ in range(4))

    def forward(self, x):
        w = self.gate(x).softmax(-1)
        k = w.argmax(-1)
        out = torch.zeros(x.shape[0], 2)
        for i, expert in enumerate(self.experts):
            if (k == i).any():
                out[k == i] = expert(x[k == i]) * w[k == i, i : i + 1]
        return out


class _LayerDrop(torch.nn.Module):  # each block skipped at random in training: no gradient when dropped
    def __init__(self):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))

    def forward(self, x):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if not (self.training and i % 2):  # (those the draw drops, on this batch)
                h = h + torch.relu(block(h))
        return self.out(h)


class _Heads(torch.nn.Module):  # a head for eval_step only; a distillation teacher run under no_grad
    def __init__(self):
        super().__init__()
        self.student, self.teacher, self.calibration = (
            torch.nn.Linear(8, 2),
            torch.nn.Linear(8, 2),
            torch.nn.Linear(2, 2),
        )


def _distill(m, batch):
    x, _ = batch
    with torch.no_grad():
        target = m.teacher(x).softmax(-1)
    return F.kl_div(m.student(x).log_softmax(-1), target, reduction="batchmean")


def _calibration(m, batch):  # (the head only eval_step uses)
    x, y = batch
    return {"acc": (m.calibration(m.student(x)).argmax(-1) == y).float().mean()}


@pytest.mark.parametrize(
    ("model", "step", "eval_step"),
    [
        pytest.param(_MoE(), _step, None, id="moe-top-1"),
        pytest.param(_LayerDrop(), _step, None, id="layer-drop"),
        pytest.param(_Heads(), _distill, _calibration, id="eval-head-and-no-grad-teacher"),
    ],
)
def test_models_whose_step_leaves_some_parameters_without_a_gradient_pass_without_a_warning(
    xy, tmp_path, model, step, eval_step
):
    """Parameters without a gradient while others get one are not warned of: from one batch, a submodule captured
    from outside cannot be told from these (and a warning that came and went broke suites run with ``-W error``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plan(model, xy, tmp_path, train_step=step, eval_step=eval_step)


def _xy(batch):
    """``(x, y)`` of a batch: a tuple's, or a dict's (``{"x", "y"}``; a Zarr store's ``{"x", "label"}``)."""
    return (batch["x"], batch["y"] if "y" in batch else batch["label"]) if isinstance(batch, dict) else batch


def _masked(m, batch):  # a mean over the labelled rows (label -1: unlabelled): NaN on a batch of none
    x, y = _xy(batch)
    labelled = y >= 0
    losses = F.cross_entropy(m(x), y.clamp(min=0), reduction="none")
    return (losses * labelled).sum() / labelled.sum()


def _ignored(m, batch):  # ignore_index: NaN on a batch whose labels are all ignored
    x, y = _xy(batch)
    return F.cross_entropy(m(x), y, ignore_index=-1)


def _unlabelled_first(xy, tmp_path, kind):
    """The data as ``kind``, its first 16 rows unlabelled (-1): the probe batch, its first rows, holds no label."""
    X, y = xy
    y = y.copy()
    y[:16] = -1
    if kind == "dict":
        return {"x": X, "y": y}
    if kind == "dataset":
        return torch.utils.data.TensorDataset(torch.as_tensor(X), torch.as_tensor(y))
    if kind == "zarr":  # (read where it lives, a batch a dict of its variables)
        xr.Dataset({"x": (("sample", "f"), X), "label": (("sample",), y)}).to_zarr(
            tmp_path / "d.zarr", consolidated=False
        )
        return str(tmp_path / "d.zarr")
    return X, y


_KINDS = ["arrays", "dict", "dataset", "zarr"]


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("step", [_masked, _ignored], ids=["masked-mean", "ignore-index"])
def test_a_masked_loss_that_is_nan_on_the_first_rows_only_passes(xy, tmp_path, kind, step):
    """The probe batch is the data's first rows, before any shuffle: a masked loss over unlabelled first rows is NaN
    there and finite on the rest (such a run trained to accuracy 0.97); tried on more rows, it passes."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plan(_net(), _unlabelled_first(xy, tmp_path, kind), tmp_path, train_step=step)


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize(("scale", "value"), [(float("nan"), "nan"), (float("inf"), "inf")], ids=["nan", "inf"])
def test_a_loss_non_finite_on_every_batch_is_refused_naming_it(xy, tmp_path, kind, scale, value):
    """A loss non-finite on the probe batch and on every batch of more rows spread over the data (a model holding
    NaN, a step that multiplies its loss by NaN) is refused: every update of the run would be non-finite."""

    def step(m, batch):
        x, y = _xy(batch)
        return F.cross_entropy(m(x), y.clamp(min=0)) * scale

    with pytest.raises(DataError) as info:  # (plan: a Zarr store's workers' access is checked after the pre-flight)
        _plan(_net(), _unlabelled_first(xy, tmp_path, kind), tmp_path, train_step=step)
    message = str(info.value)
    assert (
        f"train_step's loss is {value} on a probe batch of the training data (its first rows), and non-finite on "
        f"60 more rows across it too ({value}, {value}, {value}, {value})" in message
    )
    assert "torch.log(p + eps)" in message
    if kind == "arrays":
        refused(_net(), xy, tmp_path, DataError, f"train_step's loss is {value}", train_step=step)


def test_a_loss_non_finite_on_the_probe_batch_of_dask_arrays_is_not_refused(xy, tmp_path):
    """More rows of dask arrays are not read in the pre-flight (computing them is cluster work): a loss non-finite
    on the first rows is not refused for them (a run whose every worker sends NaN pauses, naming the training)."""
    X, y = xy
    data = (da.from_array(X, chunks=20), da.from_array(y, chunks=20))
    _plan(_net(), data, tmp_path, train_step=lambda m, b: _step(m, b) * float("nan"))


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
