"""A first hour's data, refused or taken as a newcomer means it, before any cluster work: the labels' column left
among a DataFrame's features, class ids as a column ``(n, 1)``, ``label=`` / ``features=`` / ``sample_dim=`` /
``storage_options=`` given to data that would ignore them, and a ``DataLoader`` as data.  Through ``fit``'s own
pre-flight (``vcdask.options.plan``, or ``fit`` with a client that fails the test if touched): no worker starts."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr
from refusal_helpers import refused

from vcdask.data import DataError
from vcdask.options import plan


@pytest.fixture
def xy():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 8)).astype("float32")
    return X, (X[:, 0] + X[:, 1] > 0).astype("int64")


@pytest.fixture
def df(xy):
    X, y = xy
    return pd.DataFrame(X, columns=list("abcdefgh")).assign(target=y)


def _linear(n_in=8, n_out=2):
    torch.manual_seed(0)
    return torch.nn.Linear(n_in, n_out)


def _plan(model, data, tmp_path, **kwargs):
    return plan(model, data, store=tmp_path / "store", **kwargs)


# -- the labels' column among the features -----------------------------------------------------------------------


@pytest.mark.parametrize("labels", ["series", "one_column_frame"])
def test_the_labels_column_left_among_the_features_is_refused(labels, df, tmp_path):
    """``(df, df["target"])`` trained with the labels as a feature (validation accuracy 0.9975) and predict
    failed later; a whole DataFrame with ``label=`` already refused this."""
    y = df["target"] if labels == "series" else df[["target"]]
    refused(
        _linear(9),
        (df, y),
        tmp_path,
        DataError,
        "column 'target'",
        "df.drop(columns='target')",
        "label='target'",
        "features=[...]",
    )


def test_labels_apart_from_the_features_are_taken(df, xy, tmp_path):
    """The remedies train, and so do labels that name no column of X: an unnamed Series, ``pd.DataFrame(y)``
    (its default column 0 beside ``pd.DataFrame(X)``'s positions 0..7), or the labels' column left out by
    ``features=``."""
    X, y = xy
    for data, kwargs in [
        ((df.drop(columns="target"), df["target"]), {}),
        ((df, df["target"]), {"features": list("abcdefgh")}),
        ((df.drop(columns="target"), pd.Series(y)), {}),
        ((pd.DataFrame(X), pd.DataFrame(y)), {}),
        ((pd.DataFrame(X), pd.Series(y, name=0)), {}),  # column 0 of X holds other values
    ]:
        planned = _plan(_linear(), data, tmp_path, **kwargs)
        assert planned.train.x_shape == (8,)
    with pytest.raises(DataError, match="column 0"):  # positions, but X's column 0 is the labels themselves
        _plan(_linear(), (pd.DataFrame(np.c_[y, X]), pd.Series(y, name=0)), tmp_path)


# -- class ids as a column (n, 1) -------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["numpy", "torch", "dask", "bool"])
def test_class_ids_as_a_column_from_arrays_keep_their_shape(form, xy, tmp_path):
    """``y`` of shape (n, 1) from arrays is given to a ``train_step`` as it is: one written for (n, 1), a logit per
    label, trained before f91df26 and was refused after it ("Target size (torch.Size([4])) must be the same as
    input size (torch.Size([4, 1]))"), its labels squeezed to (n,)."""
    import dask.array as da
    import torch.nn.functional as F

    X, y = xy
    column = y[:, None]
    labels = {
        "numpy": column,
        "torch": torch.from_numpy(column),
        "dask": da.from_array(column, chunks=50),
        "bool": column.astype(bool),
    }[form]

    def train_step(model, batch):
        x, t = batch
        return F.binary_cross_entropy_with_logits(model(x), t.float())

    planned = _plan(_linear(n_out=1), (X, labels), tmp_path, train_step=train_step, validation=(X[:40], column[:40]))
    assert planned.train.sample_y.shape == (4, 1)
    assert planned.train.y.shape == (200, 1)
    assert planned.validation.y.shape == (40, 1)


def test_class_ids_in_a_one_column_dataframe_are_taken_as_labels(xy, tmp_path):
    """A one-column DataFrame's ``y`` gives its column, (n,), as it always did."""
    X, y = xy
    planned = _plan(_linear(), (X, pd.DataFrame({"t": y})), tmp_path, validation=(X[:40], pd.DataFrame({"t": y[:40]})))
    assert planned.train.classification
    assert planned.train.sample_y.shape == (4,)
    assert planned.train.y.shape == (200,)
    assert planned.validation.y.shape == (40,)


class _Squeezed(torch.nn.Module):
    """``Linear(n_in, 1)`` then ``.squeeze(-1)``: outputs (n,), for labels (n,)."""

    def __init__(self, n_in=8):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(n_in, 1)

    def forward(self, x):
        return self.linear(x).squeeze(-1)


def test_float_labels_as_a_column_keep_it_from_arrays(xy, tmp_path):
    """A regression target (n, 1) from arrays against (n, 1) outputs is right as it is."""
    X, _ = xy
    target = X[:, :1] * 2.0
    planned = _plan(_linear(n_out=1), (X, target), tmp_path, loss="mse")
    assert not planned.train.classification
    assert planned.train.y.shape == (200, 1)
    assert planned.train.y.dtype == np.float32


def test_a_one_column_dataframe_of_floats_gives_labels_n(xy, tmp_path):
    """``(df, y_df)`` and ``validation=va[["y"]]`` gave float labels (n,) and trained a model of outputs (n,)
    right; taken as (n, 1) for a day, a loss of one's own broadcast them against the (n,) outputs to (n, n) and
    the model learnt the labels' mean (MSE 5.26 for 2e-12), and ``loss="mse"`` refused the model."""
    X, _ = xy
    frame = pd.DataFrame(X[:, :3], columns=list("abc")).assign(y=X[:, 0] - 2 * X[:, 1] + 0.5 * X[:, 2])
    train, va = frame.iloc[:160], frame.iloc[160:]
    data = (train[list("abc")], train[["y"]])
    validation = (va[list("abc")], va[["y"]])
    for loss in (lambda o, t: ((o - t) ** 2).mean(), "mse"):
        planned = _plan(_Squeezed(3), data, tmp_path, loss=loss, validation=validation)
        assert not planned.train.classification
        assert planned.train.y.shape == (160,)
        assert planned.train.y.dtype == np.float32
        assert planned.train.sample_y.shape == (4,)
        assert planned.validation.y.shape == (40,)


# -- label= and features= given to data that names no columns -----------------------------------------------------


@pytest.mark.parametrize(
    ("form", "kind", "fix"),
    [
        ("arrays", "(X, y) arrays", "X[:, [0, 2, 5]]"),
        ("tensors", "(X, y) arrays", "DataFrame with label= and features="),
        ("dataset", "a torch Dataset", "__getitem__"),
        ("dict", "a dict of arrays", "train_step"),
    ],
)
@pytest.mark.parametrize("options", [{"label": "target"}, {"features": ["a", "c"]}, {"features": "a", "label": "t"}])
def test_names_given_to_data_that_names_no_columns_are_refused(form, kind, fix, options, xy, tmp_path):
    """They were dropped silently: who thought they chose two columns trained on all eight."""
    X, y = xy
    data = {
        "arrays": (X, y),
        "tensors": (torch.from_numpy(X), torch.from_numpy(y)),
        "dataset": torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(y)),
        "dict": {"X": X, "y": y},
    }[form]
    step = {"train_step": lambda model, batch: model(batch["X"]).sum()} if form == "dict" else {}
    message = refused(_linear(), data, tmp_path, TypeError, kind, "xarray.Dataset", "Zarr", fix, **options, **step)
    for name, value in options.items():
        assert f"{name}={value!r}" in message


def test_label_given_beside_y_is_refused_and_features_picks_the_columns(df, tmp_path):
    refused(_linear(), (df, df["target"]), tmp_path, TypeError, "label='target'", "y holds the labels", label="target")
    planned = _plan(_linear(2), (df, df["target"]), tmp_path, features=["a", "c"])  # X's columns: used
    assert planned.train.feature_names == ("a", "c")


def test_validation_arrays_beside_a_dataframe_are_read_with_the_trainings_names(df, xy, tmp_path):
    """Validation data is read with the training's label= and features=, which its arrays do not need."""
    X, y = xy
    planned = _plan(_linear(), df, tmp_path, label="target", validation=(X[:40], y[:40]))
    assert planned.validation.n == 40


# -- sample_dim= and storage_options= given to data that would ignore them ---------------------------------------


def _forms(xy, df):
    X, y = xy
    return {
        "arrays": ((X, y), "(X, y) arrays"),
        "frame": (df, "a whole pandas DataFrame"),
        "pandas": ((df.drop(columns="target"), df["target"]), "(X, y) with y the labels"),
        "dataset": (torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(y)), "a torch Dataset"),
        "xarray": (xr.Dataset({"x": (("s", "f"), X), "y": ("s", y)}), "an xarray.Dataset"),
    }


@pytest.mark.parametrize("form", ["arrays", "frame", "pandas", "dataset"])
def test_a_sample_dim_that_the_data_would_ignore_is_refused(form, xy, df, tmp_path):
    """``sample_dim=`` was dropped silently for data whose samples are its first axis."""
    data, kind = _forms(xy, df)[form]
    label = {"label": "target"} if form == "frame" else {}
    refused(_linear(), data, tmp_path, TypeError, "sample_dim='time'", kind, "first axis", sample_dim="time", **label)


@pytest.mark.parametrize("form", ["arrays", "frame", "xarray"])
def test_storage_options_that_the_data_would_ignore_are_refused_without_their_values(form, xy, df, tmp_path):
    """``storage_options=`` open a Zarr path or URL; for data in memory they were dropped silently.  The refusal
    names their keys, never their values (which may hold credentials)."""
    data, kind = _forms(xy, df)[form]
    label = {"label": "target"} if form == "frame" else {}
    options = {"anon": False, "secret": "SECRETsecret123"}
    message = refused(
        _linear(), data, tmp_path, TypeError, "['anon', 'secret']", kind, **label, storage_options=options
    )
    assert "SECRETsecret123" not in message
    assert _plan(_linear(), data, tmp_path, storage_options={}, **label).train.n == 200  # (an empty mapping: none)


def test_sample_dim_and_storage_options_are_taken_where_they_apply(xy, df, tmp_path):
    """An xarray Dataset takes ``sample_dim``, a Zarr URL both (``file://`` included); a local path with no
    scheme takes ``sample_dim`` and refuses fsspec options (Zarr opens it without fsspec and refused them, in its
    own words)."""
    ds = _forms(xy, df)["xarray"][0]
    assert _plan(_linear(), ds, tmp_path, label="y", sample_dim="s").train.n == 200
    path = tmp_path / "data.zarr"
    ds.to_zarr(path, zarr_format=3, consolidated=False)
    url = f"file://{path}"
    planned = _plan(_linear(), url, tmp_path, label="y", sample_dim="s", storage_options={"auto_mkdir": False})
    assert planned.train.n == 200
    assert planned.train.source.storage_options == {"auto_mkdir": False}
    assert _plan(_linear(), str(path), tmp_path, label="y", sample_dim="s").train.n == 200
    refused(
        _linear(), path, tmp_path / "r", TypeError, "a local path", "file:///", label="y", storage_options={"anon": 1}
    )


# -- a DataLoader, and data of no supported kind ------------------------------------------------------------------


def _dataset(xy):
    X, y = xy
    return torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(y))


def test_a_dataloader_is_refused_with_its_dataset_as_the_remedy(xy, tmp_path):
    """It was 'unsupported data type DataLoader', with a list of inputs that left out torch Datasets."""
    loader = torch.utils.data.DataLoader(_dataset(xy), batch_size=64, shuffle=True)
    refused(_linear(), loader, tmp_path, TypeError, "DataLoader", "fit(model, loader.dataset, ...)", "batch_size=64")
    own = torch.utils.data.DataLoader(_dataset(xy), batch_size=16, collate_fn=lambda items: items)
    refused(
        _linear(), own, tmp_path, TypeError, "fit(model, loader.dataset, batch_size=16, collate_fn=loader.collate_fn)"
    )
    refused(_linear(), _dataset(xy), tmp_path, TypeError, "validation=loader.dataset", validation=loader)
    planned = _plan(_linear(), loader.dataset, tmp_path)  # the remedy
    assert planned.train.form == "dataset"


def test_data_of_no_supported_kind_lists_every_kind(xy, tmp_path):
    X, _ = xy
    message = refused(_linear(), iter(X), tmp_path, TypeError, "unsupported data type iterator")
    for kind in ("(X, y) arrays", "(DataFrame, Series)", "xarray.Dataset", "Zarr path", "Icechunk", "dict of"):
        assert kind in message
    assert "torch.utils.data.Dataset" in message


# -- a feature named as the labels, with other values ---------------------------------------------------------------


def test_a_lagged_feature_named_as_the_labels_is_taken(tmp_path):
    """Yesterday's ``sales`` as a feature beside today's ``sales`` as the labels trained, and was refused by the
    check for the labels' column among the features, which matched by name only; a column whose values are the
    labels' (in another dtype too) is still refused."""
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"sales": rng.normal(size=120).cumsum(), "price": rng.normal(size=120)})
    lagged = (df.shift(1).iloc[1:], df["sales"].iloc[1:])
    for data in (lagged, (lagged[0], lagged[1].to_frame())):
        planned = _plan(_Squeezed(2), data, tmp_path, loss="mse")
        assert planned.train.feature_names == ("sales", "price")
        assert planned.train.y.shape == (119,)
    refused(_Squeezed(2), (df, df["sales"]), tmp_path / "same", DataError, "column 'sales'")
    refused(_Squeezed(2), (df.astype("float32"), df[["sales"]]), tmp_path / "float32", DataError, "column 'sales'")
    counts = df.assign(sales=np.arange(120))  # int64 labels, their column's float copy among the features
    refused(_Squeezed(2), (counts.astype("float64"), counts["sales"]), tmp_path / "int", DataError, "column 'sales'")


def test_storage_options_for_a_validation_url_beside_data_in_memory_are_taken(xy, df, tmp_path):
    """The validation data is read with the training's storage_options: an open Dataset to train on and a Zarr URL to
    validate on take them (they were refused as ignored by the training data)."""
    ds = _forms(xy, df)["xarray"][0]
    ds.isel(s=slice(0, 40)).to_zarr(tmp_path / "val.zarr", zarr_format=3, consolidated=False)
    url = f"file://{tmp_path / 'val.zarr'}"
    planned = _plan(_linear(), ds, tmp_path, label="y", validation=url, storage_options={"auto_mkdir": False})
    assert planned.validation.n == 40
