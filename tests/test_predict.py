"""Predictions out: FitResult.predict / predict_proba match a manual forward pass of the trained model."""

from __future__ import annotations

import re
import types

import numpy as np
import pandas as pd
import pytest
import torch

import vcdask
from vcdask.data import DataError

FEATURES = ["a", "b", "c"]


def _frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    target = rng.integers(0, 3, n)
    centres = np.array([[0.0, 0.0, 1.0], [2.0, 0.0, -1.0], [0.0, 2.0, 0.0]])
    x = centres[target] + rng.normal(0, 0.3, (n, 3))
    return pd.DataFrame({"a": x[:, 0], "b": x[:, 1].astype(np.float32), "c": x[:, 2], "target": target})


def _classifier():
    torch.manual_seed(0)  # dropout: outputs differ between train and eval mode
    return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3))


@pytest.fixture(scope="module")
def classifier_run(cluster, tmp_path_factory):
    """A classifier trained on a DataFrame with label= (1 epoch on the shared cluster)."""
    result = vcdask.fit(
        _classifier(),
        _frame(200, 0),
        label="target",
        features=FEATURES,
        client=cluster[1],
        store=tmp_path_factory.mktemp("predict") / "store",
        max_epochs=1,
        n_shards=2,
        lr=0.05,
        progress=False,
    )
    return result


@pytest.fixture(scope="module")
def regression_run(cluster, tmp_path_factory):
    """A regression trained on (X, y) numpy arrays with one output per sample."""
    rng = np.random.default_rng(1)
    X = rng.random((120, 3), dtype=np.float32)
    torch.manual_seed(0)
    return vcdask.fit(
        torch.nn.Linear(3, 1),
        (X, X @ np.array([1.0, -2.0, 0.5], np.float32)),
        client=cluster[1],
        store=tmp_path_factory.mktemp("predict") / "store",
        max_epochs=1,
        n_shards=2,
        progress=False,
    )


def _manual(model, X: np.ndarray) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(np.ascontiguousarray(X, dtype=np.float32)))


def test_predict_and_predict_proba_match_a_manual_forward_pass(classifier_run):
    new = _frame(50, 7)
    logits = _manual(classifier_run.model, new[FEATURES].to_numpy(np.float32))
    classifier_run.model.train()  # the mode the user left it in is restored after predicting
    labels = classifier_run.predict(new.drop(columns="target")[["c", "a", "b"]])  # columns picked by name
    assert classifier_run.model.training
    assert int(classifier_run.history["accepted"].sum()) == 2  # one epoch of 2 shards, merged
    assert labels.dtype == np.int64 and labels.shape == (50,)
    np.testing.assert_array_equal(labels, logits.argmax(dim=-1).numpy())
    proba = classifier_run.predict_proba(new, batch_size=7)  # batches of 7 rows, extra columns ignored
    assert proba.shape == (50, 3)
    np.testing.assert_allclose(proba, torch.softmax(logits, dim=-1).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(proba.argmax(axis=1), labels)
    assert (labels == new["target"].to_numpy()).mean() > 0.5  # it learned something (chance is 1/3)


def test_predict_takes_numpy_and_torch_rows_in_any_batch_size(classifier_run):
    X = _frame(30, 8)[FEATURES].to_numpy()  # float64: cast to the model's float32
    expected = _manual(classifier_run.model, X).argmax(dim=-1).numpy()
    np.testing.assert_array_equal(classifier_run.predict(X), expected)
    np.testing.assert_array_equal(classifier_run.predict(torch.from_numpy(X), batch_size=1, device="cpu"), expected)


def test_regression_predict_returns_the_outputs(regression_run):
    X = np.random.default_rng(2).random((40, 3), dtype=np.float32)
    out = regression_run.predict(X, batch_size=16)
    assert out.shape == (40, 1) and out.dtype == np.float32
    np.testing.assert_allclose(out, _manual(regression_run.model, X).numpy(), rtol=1e-6)
    with pytest.raises(TypeError, match=r"predict_proba is for classifiers .* regression on float labels; use predict"):
        regression_run.predict_proba(X)


def test_bad_inputs_are_named(classifier_run):
    with pytest.raises(DataError, match=r"X lacks the feature column\(s\) \['b'\] the run trained on"):
        classifier_run.predict(_frame(5, 3).drop(columns="b"))
    with pytest.raises(DataError, match=r"the model cannot process X: rows of shape \(4,\)"):
        classifier_run.predict(np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        classifier_run.predict(np.zeros((5, 3)), batch_size=0)
    with pytest.raises(TypeError, match="X must be numeric rows"):
        classifier_run.predict(np.array([["x", "y", "z"]]))


def test_out_of_memory_says_to_use_a_smaller_batch_size(classifier_run):
    """Running out of memory is not the data's fault: the error stays an OutOfMemoryError and names batch_size."""
    from vcdask.predict import model_outputs
    from vcdask.spec import load_spec

    class BigBatchesExhaustMemory(torch.nn.Module):
        def forward(self, x):
            if len(x) > 8:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return torch.zeros(len(x), 3)

    spec = load_spec(classifier_run.store, classifier_run.run_id)
    rows = _frame(20, 5)[FEATURES].to_numpy(np.float32)
    with pytest.raises(torch.OutOfMemoryError, match="smaller batch_size="):
        model_outputs(BigBatchesExhaustMemory(), spec, rows, batch_size=16)
    assert model_outputs(BigBatchesExhaustMemory(), spec, rows, batch_size=8).shape == (20, 3)


class _Where(torch.nn.Module):
    """Three outputs for three features, recording the device of every batch it is given."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.devices: set[torch.device] = set()

    def forward(self, x):
        self.devices.add(x.device)
        return self.linear(x)


def test_predict_runs_where_the_model_is_unless_told(classifier_run):
    """By default predict runs where result.model is (the CPU), not on this machine's accelerator because the
    run's device was "auto"; device= takes fit's spellings ("auto" too) and names the valid ones when wrong."""
    import dataclasses

    from vcdask.device import resolve_device

    here = _Where()
    result = dataclasses.replace(classifier_run, model=here)
    rows = _frame(10, 4)[FEATURES].to_numpy(np.float32)
    assert result.predict(rows).shape == (10,)
    assert here.devices == {torch.device("cpu")}  # the model's device, whatever the run's device="auto" finds here
    auto = resolve_device("auto")
    assert result.predict(rows, device="auto").shape == (10,)  # torch.device("auto") would be a RuntimeError
    if auto.type == "cpu":
        assert here.devices == {torch.device("cpu")}
    else:  # predicted on a copy on the accelerator: the model stays where it was
        assert {d.type for d in here.devices} == {"cpu"} and next(here.parameters()).device.type == "cpu"
    assert result.predict(rows, device=torch.device("cpu")).shape == (10,)
    with pytest.raises(ValueError, match=r"device must be one of \['auto', 'cpu', 'cuda', 'cuda:N', 'mps'\].*'gpu'"):
        result.predict(rows, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"device='cuda' but this process has no CUDA device"):
            result.predict(rows, device="cuda")


def _stored(tmp_path, **variables) -> str:
    """A Zarr dataset of ``variables`` (their order kept), with labels ``y``: its location."""
    import xarray as xr

    path = str(tmp_path / "d.zarr")
    xr.Dataset({**variables, "y": ("sample", np.arange(4) % 2)}).to_zarr(path, consolidated=False)
    return path


def test_a_run_on_a_zarr_dataset_records_its_features_in_the_order_x_stacks_them(tmp_path):
    """Inferred features stack sorted by name (a, b), while the dataset, and its DataFrame, list them as
    stored (b, a): the run records the names, so predict picks a DataFrame's columns and a Dataset's variables
    by them.  A variable of several values per sample names no one column: nothing is recorded then."""
    import xarray as xr

    from vcdask.data import prepare_data
    from vcdask.predict import model_outputs
    from vcdask.variables import recorded_features

    b, a = np.arange(4, dtype=np.float32), 10 * np.arange(4, dtype=np.float32)
    prepared = prepare_data(_stored(tmp_path / "one", b=("sample", b), a=("sample", a)))
    assert recorded_features(prepared) == ("a", "b")
    wide = prepare_data(_stored(tmp_path / "wide", b=(("sample", "k"), np.ones((4, 2))), a=("sample", a)))
    assert recorded_features(wide) == ()
    in_memory = xr.Dataset({"b": ("sample", b), "a": ("sample", a), "y": ("sample", np.zeros(4))})
    assert recorded_features(prepare_data(in_memory)) == ("a", "b")  # (staged from memory: the same names)
    wide_in_memory = in_memory.assign(b=(("sample", "k"), np.ones((4, 2))))
    assert recorded_features(prepare_data(wide_in_memory)) == ()

    spec = types.SimpleNamespace(
        batch_form="xy", feature_names=("a", "b"), classification=False, x_dtype=torch.float32, cast_x=True
    )
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.0]]))  # the output is the first column, a
    ds = xr.Dataset({"b": ("sample", b), "a": ("sample", a), "y": ("sample", np.zeros(4))})
    for X in (ds.to_dataframe(), ds):  # columns b, a, y; variables b, a, y
        assert model_outputs(model, spec, X).flatten().tolist() == a.tolist()
    with pytest.raises(DataError, match=r"X lacks the feature variable\(s\) \['a'\] the run trained on"):
        model_outputs(model, spec, ds.drop_vars("a"))
    with pytest.raises(TypeError, match="did not train on named features"):
        model_outputs(model, types.SimpleNamespace(**{**vars(spec), "feature_names": ()}), ds)


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_outputs_that_are_not_one_tensor_say_to_call_the_model(form):
    """A model trained with a train_step that picks its output: predict cannot tell which to give back, and says
    so (not 'tuple' object has no attribute 'detach')."""
    from vcdask.predict import model_outputs

    class TwoOutputs(torch.nn.Module):
        def forward(self, x):
            return (x, x) if form == "tuple" else {"logits": x}

    spec = types.SimpleNamespace(batch_form="xy", feature_names=(), x_dtype=torch.float32, cast_x=True)
    shown = "a tuple of 2 (Tensor, Tensor)" if form == "tuple" else "a dict with keys ['logits']"
    with pytest.raises(
        TypeError, match=rf"need the model to return one tensor.*it returns {re.escape(shown)}.*result\.model"
    ):
        model_outputs(TwoOutputs(), spec, np.ones((4, 3), np.float32))
