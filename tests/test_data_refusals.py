"""Data that cannot train as given is refused before any cluster work, naming the bad value and the remedy:
validation labels of another kind than training's, dtypes a model cannot take, values a cast would make inf,
duplicate columns, dask DataFrames, and the probe rows that torch would warn about."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from refusal_helpers import refused as _refused

from vcdask.data import DataError


@pytest.fixture
def xy():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 3)).astype("float32")
    return X, (X[:, 0] > 0).astype("int64")


def _linear(n_out=2, n_in=3):
    torch.manual_seed(0)
    return torch.nn.Linear(n_in, n_out)


@pytest.mark.parametrize("labels", ["whole", "fractional", "out_of_range"])
def test_float_validation_labels_for_a_classifier_are_refused(labels, xy, tmp_path):
    """Cast to class ids on the workers, 0.6 would silently become 0, and 5.0 fail there with an IndexError."""
    X, y = xy
    yv = y.astype("float32") + {"whole": 0.0, "fractional": 0.6, "out_of_range": 5.0}[labels]
    _refused(
        _linear(),
        (X, y),
        tmp_path,
        DataError,
        "validation labels are float32",
        "training labels are int64",
        "classification",
        "y_val.astype('int64')",
        validation=(X, yv),
    )


def test_integer_validation_labels_for_a_regression_are_refused(xy, tmp_path):
    X, y = xy
    _refused(
        _linear(1),
        (X, X[:, 0].copy()),
        tmp_path,
        DataError,
        "validation labels are int64",
        "training labels are float32",
        "regression",
        "y_val.astype('float32')",
        validation=(X, y),
    )


def test_validation_labels_of_the_same_kind_are_taken(xy, tmp_path):
    from vcdask.options import plan

    X, y = xy
    planned = plan(_linear(), (X, y), validation=(X, y.astype("int32")), store=tmp_path / "s")
    assert planned.validation is not None and planned.validation.n == 40


def test_a_tensor_datasets_labels_are_range_checked_whole(xy, tmp_path):
    """Not only on the probe batch of its first items: a label out of range further in is refused too."""
    X, y = xy
    y = y.copy()
    y[30] = 9
    data = torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(y))
    _refused(_linear(), data, tmp_path, DataError, "labels range over [0, 9]", "labels must be in [0, 1]")


def test_another_datasets_labels_are_range_checked_on_its_first_items(xy):
    """As docs/user-guide/data.md says: an arbitrary Dataset is not read whole."""
    from vcdask.data import prepare_data

    X, y = xy

    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return len(X)

        def __getitem__(self, i):
            return torch.from_numpy(X[i]), 9 if i == 30 else int(y[i])

    assert prepare_data(Pairs()).label_range == (int(y[:4].min()), int(y[:4].max()))


def _overflowing(xy):
    X, y = xy
    Xb = X.astype("float64")
    Xb[10, 1] = 1e39
    return Xb, y


@pytest.mark.parametrize("lazy", [False, True])
def test_float64_values_beyond_the_models_float32_are_refused(lazy, xy, tmp_path):
    """They pass a finite check as float64, and become inf in the cast to the model's dtype."""
    import dask.array as da

    X, y = _overflowing(xy)
    said = ["data X has 1 value(s) beyond the range of float32", "sample 10 (index [10, 1])"]
    said += ["cast to the model's dtype, float32", "model.double()"]
    if not lazy:
        _refused(_linear(), (X, y), tmp_path, DataError, *said)
        return
    # dask data is scanned on the cluster of client= (tests/test_review69_dask_checks.py); without one, here
    from vcdask.options import plan

    store = tmp_path / "store"
    with pytest.raises(DataError) as info:
        plan(_linear(), (da.from_array(X, chunks=8), da.from_array(y, chunks=8)), store=store)
    assert all(fragment in str(info.value) for fragment in said) and not store.exists()


def test_float64_labels_beyond_float32_are_refused_for_validation_too(xy, tmp_path):
    X, y = xy
    yv = X[:, 0].astype("float64")
    yv[3] = -1e39
    _refused(
        _linear(1),
        (X, X[:, 0].copy()),
        tmp_path,
        DataError,
        "validation y has 1 value(s) beyond the range of float32",
        validation=(X, yv),
    )


def test_a_float64_model_takes_float64_values_beyond_float32(xy, tmp_path):
    from vcdask.options import plan

    X, y = _overflowing(xy)
    planned = plan(_linear().double(), (X, y), store=tmp_path / "s")
    assert planned.x_dtype == torch.float64 and planned.train.n == 40


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_float32_data_for_a_float64_model_is_checked_without_a_warning(xy, tmp_path):
    """No float32 value can exceed float64's range: comparing float32's largest with float64's must not cast the
    latter to float32 (NumPy 2 does, with an overflow warning)."""
    from vcdask.options import plan

    X, y = xy
    planned = plan(_linear().double(), (np.asarray(X, dtype="float32"), y), store=tmp_path / "s")
    assert planned.x_dtype == torch.float64


def test_a_dataframe_column_beyond_float32_is_refused_naming_the_cast(xy, tmp_path):
    """Not as non-finite values: the DataFrame holds none until its features are cast to float32."""
    import pandas as pd

    X, y = _overflowing(xy)
    df = pd.DataFrame({"a": X[:, 0], "b": X[:, 1], "c": X[:, 2], "y": y})
    message = _refused(
        _linear(), df, tmp_path, DataError, "beyond float32's range", "{'b': 1}", "cast to float32", "clip"
    )
    assert "non-finite" not in message
    reg = df.assign(y=X[:, 1], b=X[:, 0])
    _refused(_linear(1), reg, tmp_path, DataError, "labels in column 'y' has 1 value(s) beyond float32's range")


@pytest.mark.parametrize("duplicated", ["feature", "label", "tuple"])
def test_duplicate_dataframe_columns_are_refused_naming_them(duplicated, xy, tmp_path):
    """pandas gives a DataFrame for such a name, where vcdask expects a column (a raw AttributeError before)."""
    import pandas as pd

    X, y = xy
    df = pd.DataFrame({"a": X[:, 0], "b": X[:, 1], "y": y})
    if duplicated == "feature":
        data = pd.concat([df[["a"]], df], axis=1)
    elif duplicated == "label":
        data = pd.concat([df, df[["y"]]], axis=1)
    else:
        data = (pd.concat([df[["a"]], df[["a", "b"]]], axis=1), df["y"])
    name = "'y': 2" if duplicated == "label" else "'a': 2"
    _refused(_linear(), data, tmp_path, DataError, "duplicate column names", name, "df.columns.duplicated()")


def test_a_duplicate_column_left_out_of_features_is_no_matter(xy, tmp_path):
    import pandas as pd

    from vcdask.options import plan

    X, y = xy
    df = pd.concat([pd.DataFrame({"a": X[:, 0], "b": X[:, 1], "c": X[:, 2], "y": y}), pd.DataFrame({"c": y})], axis=1)
    planned = plan(_linear(2, 2), df, features=["a", "b"], store=tmp_path / "s")
    assert planned.train.feature_names == ("a", "b")


def _dask_collection(name):
    """A stand-in of dask.dataframe's ``name`` (dask.dataframe needs pyarrow, which the test environment may lack):
    of its module, and a dask collection as far as ``__dask_graph__`` tells."""
    return type(name, (), {"__module__": "dask.dataframe.dask_expr._collection", "__dask_graph__": None})()


@pytest.mark.parametrize("form", ["frame", "tuple", "frame-and-pandas-labels"])
def test_a_dask_dataframe_is_refused_naming_its_type_and_to_dask_array(form, xy, tmp_path):
    import pandas as pd

    frame = _dask_collection("DataFrame")
    data = {
        "frame": frame,
        "tuple": (frame, _dask_collection("Series")),
        "frame-and-pandas-labels": (frame, pd.Series(xy[1])),
    }[form]
    message = _refused(
        _linear(),
        data,
        tmp_path,
        TypeError,
        "(dask.dataframe.dask_expr._collection.DataFrame)",
        "ddf[features].to_dask_array(lengths=True)",
        "ddf.compute()",
        label="y" if form == "frame" else None,
    )
    assert "compute_chunk_sizes" not in message
    assert ("ddf['y'].to_dask_array(lengths=True)" in message) == (form == "frame")


def test_a_real_dask_dataframe_is_refused_naming_to_dask_array(xy, tmp_path):
    """As the stand-ins above are (this one needs pyarrow for dask.dataframe)."""
    dd = pytest.importorskip("dask.dataframe")
    import pandas as pd

    X, y = xy
    ddf = dd.from_pandas(pd.DataFrame({"a": X[:, 0], "b": X[:, 1], "y": y}), npartitions=4)
    _refused(_linear(2, 2), ddf, tmp_path, TypeError, "DataFrame)", "to_dask_array(lengths=True)", label="y")
    _refused(_linear(2, 2), (ddf[["a", "b"]], ddf["y"]), tmp_path, TypeError, "to_dask_array(lengths=True)")


@pytest.mark.parametrize(
    ("dtype", "holds", "fix"),
    [
        ("datetime64[s]", "datetimes (datetime64[s])", "np.timedelta64(1, 's')"),
        ("timedelta64[s]", "durations (timedelta64[s])", "np.timedelta64(1, 's')"),
        ("complex64", "complex numbers (complex64)", "np.stack([X.real, X.imag], axis=-1)"),
        ("V8", "structured records (or raw bytes) (|V8)", "structured_to_unstructured"),
    ],
)
def test_inputs_a_model_cannot_take_as_numbers_are_refused_naming_them(dtype, holds, fix, xy, tmp_path):
    """torch refused datetimes with a raw TypeError, and cast complex inputs to floats without their imaginary part."""
    X, y = xy
    bad = np.zeros((len(X), 3), dtype=dtype) if dtype.startswith("V") else np.arange(X.size).reshape(X.shape)
    _refused(_linear(), (bad.astype(dtype), y), tmp_path, TypeError, f"data X holds {holds}", fix)


def test_complex_labels_are_refused(xy, tmp_path):
    X, y = xy
    _refused(_linear(1), (X, X[:, 0] + 1j), tmp_path, TypeError, "data y holds complex numbers (complex64)")


@pytest.mark.parametrize("zarr", [False, True])
def test_an_xarray_variable_a_model_cannot_take_is_named_before_stacking(zarr, xy, tmp_path):
    """Among numeric ones, numpy refused to stack it (DTypePromotionError), naming no variable."""
    import xarray as xr

    X, y = xy
    n = len(X)
    ds = xr.Dataset(
        {
            "a": (("s",), X[:, 0]),
            "t": (("s",), np.arange(n).astype("datetime64[s]")),
            "z": (("s",), X[:, 1] + 1j),
            "y": (("s",), y),
        }
    )
    if zarr:
        ds.to_zarr(tmp_path / "d.zarr", consolidated=False)
    _refused(
        _linear(),
        str(tmp_path / "d.zarr") if zarr else ds,
        tmp_path,
        TypeError,
        "data variable 't' holds datetimes (datetime64[",  # ([ns] once through Zarr)
        "]); data variable 'z' holds complex numbers (complex64)",
        "np.timedelta64(1, 's')",
        "imaginary part",
    )


def test_a_complex_dataframe_column_is_refused(xy, tmp_path):
    import pandas as pd

    X, y = xy
    df = pd.DataFrame({"a": X[:, 0], "z": X[:, 1] + 1j, "y": y})
    message = _refused(
        _linear(), df, tmp_path, DataError, "complex ['z']", "z: complex64", "real and imaginary parts of ['z']"
    )
    assert "get_dummies" not in message  # (one-hot encoding is no remedy for it)


def test_validation_of_another_kind_of_data_names_the_kinds(xy, tmp_path):
    """Not "validation samples have shapes {'X': (3,)}, training samples {'X': (3,)}": equal shapes."""
    X, y = xy
    data = torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(y))
    message = _refused(
        _linear(),
        data,
        tmp_path,
        DataError,
        "validation is (X, y) arrays",
        "the training data is a torch Dataset",
        "torch.utils.data.TensorDataset(torch.as_tensor(X_val), torch.as_tensor(y_val))",
        validation=(X, y),
    )
    assert "shapes" not in message
    _refused(_linear(), (X, y), tmp_path, DataError, "validation is a torch Dataset", validation=data)


def test_a_datasets_string_labels_get_the_string_label_advice(xy, tmp_path):
    """Not "the default step needs dataset items (x, y) of tensors": the items are pairs, of a string label."""
    X, y = xy

    class Named(torch.utils.data.Dataset):
        def __len__(self):
            return len(X)

        def __getitem__(self, i):
            return torch.from_numpy(X[i]), "cat" if y[i] else "dog"

    message = _refused(
        _linear(),
        Named(),
        tmp_path,
        DataError,
        "the dataset's labels are strings (e.g. 'cat', 'cat', 'cat')",
        "pandas.factorize",
        "__getitem__ returns the code",
    )
    assert "of tensors" not in message


@pytest.mark.parametrize("source", ["read-only", "memmap"])
def test_read_only_arrays_are_probed_on_writable_copies_of_a_few_rows(source, xy, tmp_path):
    """torch warns that a non-writable NumPy array makes a tensor of undefined behaviour (a read-only memmap,
    pandas 3's to_numpy()); the probe rows are copies, and the data is not copied whole."""
    import warnings

    from vcdask.data import prepare_data
    from vcdask.options import plan

    X, y = xy
    if source == "memmap":
        np.save(tmp_path / "X.npy", X)
        X = np.load(tmp_path / "X.npy", mmap_mode="r")
    else:
        X = X.copy()
        X.setflags(write=False)
    prepared = prepare_data((X, y))
    assert prepared.sample_X.flags.writeable and prepared.X is X
    dict_prepared = prepare_data({"x": X, "y": y})
    assert dict_prepared.sample["x"].flags.writeable
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan(_linear(), (X, y), store=tmp_path / "s")
    assert not [w for w in caught if "not writable" in str(w.message)]
