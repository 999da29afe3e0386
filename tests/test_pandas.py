"""pandas in: a DataFrame with ``label=`` / ``features=``, ``(DataFrame, Series)``, checked before any cluster work."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from refusal_helpers import NoCluster

import vcdask
from vcdask.data import DataError, prepare_data


def frame(n: int = 300, seed: int = 0) -> pd.DataFrame:
    """Three classes that the numeric columns separate, beside a bool, a category and a string column."""
    rng = np.random.default_rng(seed)
    target = rng.integers(0, 3, n)
    centres = np.array([[0.0, 0.0, 1.0], [2.0, 0.0, -1.0], [0.0, 2.0, 0.0]])
    numbers = centres[target] + rng.normal(0, 0.3, (n, 3))
    return pd.DataFrame(
        {
            "a": numbers[:, 0],  # float64
            "b": numbers[:, 1].astype(np.float32),
            "c": (numbers[:, 2] * 2).round().astype(np.int32),
            "flag": target == 1,
            "colour": pd.Categorical(rng.choice(["red", "green"], n)),
            "name": [f"row{i}" for i in range(n)],
            "target": target,
        }
    )


NUMERIC = ["a", "b", "c", "flag"]


def _refused(df_or_data, tmp_path, *fragments, exc=DataError, **kwargs) -> str:
    store = tmp_path / "store"
    with pytest.raises(exc) as info:
        vcdask.fit(torch.nn.Linear(4, 3), df_or_data, client=NoCluster(), store=store, progress=False, **kwargs)
    assert not store.exists()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_dataframe_with_label_becomes_float32_features_and_int64_classes():
    df = frame()
    prepared = prepare_data(df, features=NUMERIC, label="target")
    assert prepared.feature_names == tuple(NUMERIC)
    assert prepared.X.dtype == np.float32 and prepared.X.shape == (300, 4)
    assert prepared.y.dtype == np.int64 and prepared.classification
    assert (prepared.y_min, prepared.y_max) == (0, 2)
    np.testing.assert_array_equal(prepared.X[:, 0], df["a"].to_numpy(np.float32))
    np.testing.assert_array_equal(prepared.X[:, 3], df["flag"].to_numpy(np.float32))  # bool -> 0.0 / 1.0
    np.testing.assert_array_equal(prepared.y, df["target"].to_numpy())
    assert prepared.X.flags.writeable and prepared.y.flags.writeable


def test_default_features_are_all_columns_but_the_label_and_the_label_is_found_by_name():
    df = frame()[["a", "c", "target"]]
    prepared = prepare_data(df)  # "target" is one of the names found automatically
    assert prepared.feature_names == ("a", "c")
    regression = prepare_data(df.assign(target=df["a"] * 2.0), label="target", features="c")
    assert regression.feature_names == ("c",) and regression.X.shape == (300, 1)
    assert regression.y.dtype == np.float32 and not regression.classification


def test_categorical_and_string_columns_are_refused_naming_them_and_the_remedy(tmp_path):
    _refused(
        frame(),
        tmp_path,
        "feature columns must be numeric or bool (they become float32)",
        "categorical ['colour']",
        "string/object ['name']",
        "pandas.get_dummies(df, columns=['colour', 'name'], dtype=float)",
        ".cat.codes",
        "features=[...]",
        label="target",
    )


def test_unknown_columns_and_missing_labels_are_named(tmp_path):
    df = frame()[["a", "b", "target"]]
    _refused(
        df, tmp_path, "label column 'species' is not in the DataFrame; columns: ['a', 'b', 'target']", label="species"
    )
    _refused(df, tmp_path, "feature column(s) ['z'] not in the DataFrame", features=["a", "z"], label="target")
    _refused(df.rename(columns={"target": "kind"}), tmp_path, "pass label=<column>", "['a', 'b', 'kind']")
    _refused(df, tmp_path, "the label column 'target' is also among features", features=["a", "target"])


def test_missing_values_are_refused_with_the_remedy(tmp_path):
    df = frame()[["a", "b", "target"]]
    df.loc[[3, 7], "b"] = np.nan
    _refused(df, tmp_path, "missing values {'b': 2}", "df.dropna(subset=['b'])", label="target")


def test_string_labels_in_a_dataframe_point_to_factorize(tmp_path):
    df = frame()[["a", "b", "c", "flag"]].assign(species=np.array(["cat", "dog", "owl"])[frame()["target"]])
    _refused(
        df, tmp_path, "data: the labels in column 'species' are strings (e.g. ", "pandas.factorize", label="species"
    )
    df["species"] = df["species"].astype("category")
    _refused(df, tmp_path, "data: the labels in column 'species' are categorical", "s.cat.codes", label="species")


def test_dataframe_series_pair_is_writable_and_warns_nothing():
    df = frame()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "The given NumPy array is not writable" would raise here
        prepared = prepare_data((df[NUMERIC], df["target"]))
        torch.as_tensor(prepared.sample_X), torch.as_tensor(prepared.sample_y)
        torch.as_tensor(prepared.y)
    assert prepared.feature_names == tuple(NUMERIC) and prepared.y.dtype == np.int64
    assert prepared.X.flags.writeable and prepared.y.flags.writeable
    # pandas 3 (copy-on-write) hands out a column as a read-only view: the warning this conversion avoids
    # (pandas 2, which pyproject allows, hands out a writable one)
    if int(pd.__version__.split(".")[0]) >= 3:
        assert not np.asarray(df["target"]).flags.writeable


def test_dataframe_trains_with_validation_dataframe(client, tmp_path):
    df = frame(seed=1)
    train, val = df.iloc[:240], df.iloc[240:]
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = vcdask.fit(
            torch.nn.Linear(4, 3),
            train,
            label="target",
            features=NUMERIC,
            validation=val,
            client=client,
            store=tmp_path / "store",
            max_epochs=2,
            n_shards=2,
            lr=0.1,
            batch_size=16,
            progress=False,
        )
    assert not [w for w in caught if "not writable" in str(w.message)]
    assert len(result.epochs) == 2 and int(result.history["accepted"].sum()) == 4
    assert result.metrics["accuracy"] > 0.7  # chance is 1/3
    spec = vcdask.spec.load_spec(result.store, result.run_id)
    assert spec.feature_names == tuple(NUMERIC) and spec.classification


def test_validation_dataframe_columns_are_matched_by_name_not_position(tmp_path):
    """A validation frame with the same columns in another order is read in the training columns' order
    (a positional read would score the model on swapped features)."""
    import inspect

    from vcdask.options import plan as plan_run

    df = frame()[[*NUMERIC, "target"]]
    val = frame(seed=1)[["flag", "c", "target", "b", "a"]]
    defaults = {
        k: p.default
        for k, p in inspect.signature(vcdask.fit).parameters.items()
        if p.default is not inspect.Parameter.empty and k in inspect.signature(plan_run).parameters
    }
    options = {**defaults, "label": "target", "validation": val, "store": tmp_path / "store"}
    plan = plan_run(torch.nn.Linear(4, 3), df, **options)
    assert plan.train.feature_names == plan.validation.feature_names == tuple(NUMERIC)
    expected = val[NUMERIC].to_numpy(np.float32)
    np.testing.assert_array_equal(np.asarray(plan.validation.X), expected)


def test_bool_labels_are_two_classes_as_arrays_and_as_a_dataframe(tmp_path):
    """Bool labels are classification (cross-entropy, accuracy) whether they come as an array or a DataFrame
    column; a one-output model is refused on both paths (the array's message says what bool labels are)."""
    from vcdask.options import plan

    rng = np.random.default_rng(0)
    X = rng.random((64, 3)).astype(np.float32)
    y = rng.random(64) > 0.5
    df = pd.DataFrame(X, columns=list("abc")).assign(t=y)
    store = tmp_path / "store"
    plans = {
        "arrays": plan(torch.nn.Linear(3, 2), (X, y), store=store),
        "torch": plan(torch.nn.Linear(3, 2), (torch.from_numpy(X), torch.from_numpy(y)), store=store),
        "frame": plan(torch.nn.Linear(3, 2), df, label="t", store=store),
        "frame, series": plan(torch.nn.Linear(3, 2), (df[list("abc")], df["t"]), store=store),
    }
    for how, p in plans.items():
        assert p.train.classification, how
        assert p.train.label_range == (0, 1), how
        assert p.loss is torch.nn.functional.cross_entropy and list(p.metrics) == ["accuracy"], how
    with pytest.raises(DataError, match=r"outputs 1 classes; labels must be in \[0, 0\]"):
        plan(torch.nn.Linear(3, 1), df, label="t", store=store)
    with pytest.raises(DataError, match=r"outputs 1 classes; .*\(bool labels are two classes, False 0 and True 1"):
        plan(torch.nn.Linear(3, 1), (X, y), store=store)
