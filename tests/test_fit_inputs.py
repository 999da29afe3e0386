"""fit's inputs: bad ones fail before any cluster work; xarray, dask and Zarr data train."""

from __future__ import annotations

import math

import dask.array as da
import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr
from refusal_helpers import NoCluster

import vcdask
from vcdask.data import DataError
from vcdask.schedules import UnknownScheduleError


def _linear(n_out=10):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, n_out))


@pytest.fixture
def xy():
    rng = np.random.default_rng(0)
    return rng.random((100, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 100)


def _bad(model, data, tmp_path, exc, match, **kwargs):
    store = tmp_path / "store"
    with pytest.raises(exc, match=match):
        vcdask.fit(model, data, client=NoCluster(), store=store, progress=False, **kwargs)
    assert not store.exists(), "the store was created before the input was rejected"


@pytest.mark.parametrize("alpha", [1.5, -0.1, math.nan])
def test_alpha_out_of_range(alpha, xy, tmp_path):
    _bad(_linear(), xy, tmp_path, ValueError, r"alpha must be in \[0, 1\], got", alpha=alpha)


def test_unknown_schedule(xy, tmp_path):
    _bad(_linear(), xy, tmp_path, UnknownScheduleError, r"'linear'.*available: \['epoch'\]", alpha="linear")


@pytest.mark.parametrize(
    ("n_shards", "match"),
    [
        (0, "n_shards must be an integer >= 1, got 0"),
        (
            101,
            r"n_shards=101 is more than the 100 training samples; "
            r"choose 1 <= n_shards <= 100",
        ),
    ],
)
def test_bad_n_shards(n_shards, match, xy, tmp_path):
    _bad(_linear(), xy, tmp_path, ValueError, match, n_shards=n_shards)


@pytest.mark.parametrize(("value", "exc"), [(0, ValueError), ("often", ValueError), (2.5, TypeError)])
def test_bad_validate_every_names_the_choices(value, exc, xy, tmp_path):
    _bad(
        _linear(),
        xy,
        tmp_path,
        exc,
        r"validate_every must be an integer >= 1 or 'auto', got",
        validate_every=value,
    )


def test_a_bad_overlap_in_the_config_fails_before_any_cluster_work(xy, tmp_path):
    import dask

    with dask.config.set({"vcdask.worker.overlap": "sometimes"}):
        _bad(
            _linear(),
            xy,
            tmp_path,
            ValueError,
            r"overlap must be one of \['delta', 'wait', 'newest'\], got 'sometimes'",
        )


def test_length_mismatch(xy, tmp_path):
    X, y = xy
    _bad(
        _linear(),
        (X, y[:90]),
        tmp_path,
        DataError,
        "X has 100 samples but y has 90",
    )


def test_not_a_module(xy, tmp_path):
    _bad(lambda x: x, xy, tmp_path, TypeError, "model must be a torch.nn.Module, got function")


@pytest.mark.parametrize("bad_label", [10, -1])
def test_labels_out_of_range(bad_label, xy, tmp_path):
    X, y = xy
    y = y.copy()
    y[7] = bad_label
    _bad(
        _linear(),
        (X, y),
        tmp_path,
        DataError,
        r"labels range over .* but the model outputs 10 classes; "
        r"labels must be in \[0, 9\]",
    )


@pytest.mark.parametrize("bad_label", [10, -1])
def test_validation_labels_out_of_range_are_refused_before_any_work(bad_label, xy, tmp_path):
    """Every validation task would fail on them mid-run (on a GPU, a device-side assert)."""
    X, y = xy
    yv = y[:20].copy()
    yv[3] = bad_label
    _bad(
        _linear(),
        (X, y),
        tmp_path,
        DataError,
        r"validation labels range over .* but the model outputs 10 classes",
        validation=(X[:20], yv),
    )


def test_a_shard_read_from_zarr_does_not_read_the_sample_coordinate_whole():
    """Opening the dataset for a shard's rows built an index over the sample dimension, reading its whole
    coordinate (160 MB for 20 million int64 time stamps, over S3 at every task) to take 1,000 rows."""
    import xarray as xr
    import zarr

    from vcdask.data import DataSource

    read: list[str] = []

    class Counting(zarr.storage.MemoryStore):  # (zarr makes read-only copies of a store: the list is shared)
        async def get(self, key, prototype, byte_range=None):
            read.append(key)
            return await super().get(key, prototype, byte_range)

    store = Counting()
    n = 1000
    ds = xr.Dataset(
        {"x": (("time",), np.arange(n, dtype="f4")), "y": (("time",), np.arange(n) % 3)},
        coords={"time": np.arange(n, dtype="i8")},
    )
    ds.to_zarr(store, zarr_format=3, consolidated=False, encoding={v: {"chunks": (100,)} for v in ("x", "y", "time")})
    read.clear()
    X, y = DataSource(url=None, features=("x",), label="y", sample_dim="time", n=n, zarr_store=store).read(200, 210)
    assert X.ravel().tolist() == list(range(200, 210)) and y.tolist() == [i % 3 for i in range(200, 210)]
    assert not [k for k in read if k.startswith("time/c")], read


def test_empty_data(tmp_path):
    _bad(
        _linear(),
        (np.zeros((0, 1, 8, 8), np.float32), np.zeros(0, np.int64)),
        tmp_path,
        DataError,
        r"data is empty \(0 samples\)",
    )


def test_model_cannot_take_data(xy, tmp_path):
    X, y = xy
    _bad(
        torch.nn.Linear(3, 10),
        (X, y),
        tmp_path,
        DataError,
        r"cannot process the training data: samples of "
        r"shape \(1, 8, 8\)",
    )


def test_bad_data_type(tmp_path):
    _bad(_linear(), 42, tmp_path, TypeError, "unsupported data type int")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_epochs": 0}, "max_epochs must be an integer >= 1, got 0"),
        ({"batch_size": 2.5}, "batch_size must be an integer >= 1, got 2.5"),
        ({"validation": 1.5}, r"validation as a fraction must be in \(0, 1\), got 1.5"),
        ({"target": {"f1": 0.9}}, r"target metric 'f1' is not computed; available: \['loss', 'accuracy'\]"),
        ({"metrics": ["auc"]}, r"unknown metric 'auc'; available: \['accuracy', 'mae', 'mse'\]"),
        ({"loss": "hinge"}, r"unknown loss 'hinge'; available: \['cross_entropy', 'l1', 'mse', 'nll'\]"),
        ({"lr": -1}, "lr must be a positive number, got -1"),
    ],
)
def test_bad_options(kwargs, match, xy, tmp_path):
    _bad(_linear(), xy, tmp_path, (ValueError, TypeError), match, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        # numpy would refuse these only while splitting the data, in a message that does not name seed
        ({"seed": "a"}, TypeError, r"^seed must be an integer >= 0, got 'a'$"),
        ({"seed": -1}, ValueError, r"^seed must be an integer >= 0, got -1$"),
        ({"seed": 1.5}, TypeError, r"^seed must be an integer >= 0, got 1\.5$"),
        # a truthy string would switch the option on (speed_adaptive always refused one)
        ({"shuffle": "no"}, TypeError, r"^shuffle must be True or False, got 'no'$"),
        ({"keep_updates": 1}, TypeError, r"^keep_updates must be True or False, got 1$"),
        ({"progress": "off"}, TypeError, r"^progress must be True or False, got 'off'$"),
        ({"wait": None}, TypeError, r"^wait must be True or False, got None$"),
    ],
)
def test_a_bad_seed_or_flag_is_named_before_any_work(kwargs, exc, match, xy, tmp_path):
    store = tmp_path / "store"
    with pytest.raises(exc, match=match):
        vcdask.fit(_linear(), xy, client=NoCluster(), store=store, **{"progress": False, **kwargs})
    assert not store.exists()


def test_numpy_seeds_and_flags_are_taken(xy, tmp_path):
    from vcdask.options import plan

    checked = plan(_linear(), xy, seed=np.int64(3), shuffle=np.True_, keep_updates=np.False_, store=tmp_path)
    assert (checked.seed, checked.keep_updates) == (3, False)
    assert type(checked.seed) is int and type(checked.keep_updates) is bool


def test_bad_client(xy, tmp_path):
    with pytest.raises(TypeError, match=r"client must be a distributed.Client, a Dask cluster .*, a scheduler address"):
        vcdask.fit(_linear(), xy, client=8786, store=tmp_path / "s", progress=False)
    with pytest.raises(
        ValueError, match=r"client='nowhere' is not a scheduler address such as 'tcp://10\.0\.0\.5:8786'"
    ):
        vcdask.fit(_linear(), xy, client="nowhere", store=tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


def test_a_scheduler_address_runs_there_and_the_run_closes_the_client_it_opened(xy, tmp_path):
    """fit(client="tcp://...") connects as distributed.Client(address) does; the client it opened is its own:
    closed when fit returns, or by the handle once its result is collected (wait=False)."""
    import time

    from distributed import LocalCluster

    def clients(cluster) -> set[str]:  # (not the run's own, which its driver opens on the scheduler)
        return {c for c in cluster.scheduler.clients if c != "fire-and-forget" and "-vcdask-run-" not in c}

    def settled(cluster, expected: set[str]) -> set[str]:
        deadline = time.monotonic() + 5
        while clients(cluster) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        return clients(cluster)

    options = {"max_epochs": 1, "n_shards": 2, "progress": False}
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
        address = cluster.scheduler_address
        before = clients(cluster)
        result = vcdask.fit(_linear(), xy, client=address, store=tmp_path / "a", **options)
        assert int(result.history["accepted"].sum()) == 2  # its two shards trained on that cluster and merged
        assert set(result.workers["worker"]) <= set(cluster.scheduler.workers)
        assert settled(cluster, before) == before  # the client fit opened is closed
        handle = vcdask.fit(_linear(), xy, client=address, store=tmp_path / "b", wait=False, **options)
        assert len(clients(cluster) - before) == 1  # the handle's own client, open while the run is
        assert int(handle.result().history["accepted"].sum()) == 2
        assert settled(cluster, before) == before


def test_memory_store_with_worker_processes(xy):
    with pytest.raises(ValueError, match="lives in this process only"):
        vcdask.fit(_linear(), xy, store="memory://fit-test", progress=False)


# -- data inputs that train ---------------------------------------------------------------
def _check_run(result, epochs, shards):
    accepted = result.history[result.history.accepted]
    assert len(accepted) == epochs * shards
    assert not accepted.duplicated(["epoch", "shard"]).any()
    assert result.metrics["accuracy"] > 0.5  # well above chance (0.1) after a few epochs


@pytest.mark.slow
def test_fit_xarray_dataset(client, digits_data, tmp_path):
    (X, y), _ = digits_data
    ds = xr.Dataset({"image": (("sample", "row", "col"), X[:, 0]), "label": ("sample", y)})
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    result = vcdask.fit(
        model,
        ds,
        validation=0.2,
        max_epochs=3,
        n_shards=4,
        local_epochs=4,
        alpha=0.5,
        client=client,
        store=tmp_path / "s",
        progress=False,
    )
    _check_run(result, 3, 4)


@pytest.mark.slow
def test_fit_dask_arrays(client, digits_data, tmp_path):
    (X, y), _ = digits_data
    dX, dy = da.from_array(X, chunks=(250, 1, 8, 8)), da.from_array(y, chunks=250)
    result = vcdask.fit(
        _linear(),
        (dX, dy),
        validation=(dX[-200:], dy[-200:]),
        max_epochs=3,
        n_shards=5,
        local_epochs=4,
        alpha=0.5,
        client=client,
        store=tmp_path / "s",
        progress=False,
    )
    _check_run(result, 3, 5)
    assert result.store.files.list(f"{result.run_id}/train.zarr")  # staged by the cluster


@pytest.mark.slow
def test_fit_zarr_url_read_in_place(client, digits_data, tmp_path):
    (X, y), _ = digits_data
    path = tmp_path / "digits.zarr"
    xr.Dataset({"pixels": (("n", "h", "w"), X[:, 0]), "y": ("n", y)}).to_zarr(path, zarr_format=3, consolidated=False)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    result = vcdask.fit(
        model,
        str(path),
        validation=0.2,
        max_epochs=3,
        n_shards=4,
        local_epochs=4,
        alpha=0.5,
        client=client,
        store=tmp_path / "s",
        progress=False,
    )
    _check_run(result, 3, 4)
    assert not result.store.files.list(f"{result.run_id}/train.zarr")  # nothing staged: read where it lives


@pytest.mark.slow
def test_fit_icechunk_session(client, digits_data, tmp_path):
    import icechunk

    (X, y), _ = digits_data
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "data-repo")))
    session = repo.writable_session("main")
    xr.Dataset({"X": (("sample", "c", "h", "w"), X), "y": ("sample", y)}).to_zarr(
        session.store, zarr_format=3, consolidated=False
    )
    session.commit("digits")
    data = repo.readonly_session(branch="main")
    result = vcdask.fit(
        _linear(),
        data,
        validation=0.2,
        max_epochs=3,
        n_shards=4,
        local_epochs=4,
        alpha=0.5,
        client=client,
        store=tmp_path / "s",
        progress=False,
    )
    _check_run(result, 3, 4)


@pytest.mark.slow
def test_dask_data_is_staged_by_the_workers(client, digits_data, tmp_path):
    """The dask graph runs on the cluster's workers, not in the process that called fit."""
    import os

    (X, _), _ = digits_data

    def pid_of_computing_process(block):
        return np.full(block.shape, os.getpid(), dtype=np.float64)

    y = da.zeros(len(X), chunks=300).map_blocks(pid_of_computing_process, dtype=np.float64)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 1)).double()
    result = vcdask.fit(
        model,
        (da.from_array(X.astype(np.float64), chunks=(300, 1, 8, 8)), y),
        max_epochs=1,
        n_shards=2,
        lr=1e-9,
        client=client,
        store=tmp_path / "s",
        progress=False,
        shuffle=False,
    )
    staged = xr.open_zarr(f"{result.store.location}/runs/{result.run_id}/train.zarr", consolidated=False)
    computed_by = set(np.unique(staged["y"].values).astype(int))
    assert computed_by, "nothing staged"
    assert computed_by <= set(client.run(os.getpid).values())
    assert os.getpid() not in computed_by


def test_in_memory_data_is_staged_while_the_embedded_cluster_starts_and_dask_data_after(xy, tmp_path):
    """Numpy data is written from this process, so fit stages it in a thread while the embedded
    cluster starts; dask data is written by the workers, so it waits for them."""
    import inspect

    from vcdask.options import plan as plan_run
    from vcdask.runs import _in_memory

    accepted = inspect.signature(plan_run).parameters
    defaults = {
        k: p.default
        for k, p in inspect.signature(vcdask.fit).parameters.items()
        if p.default is not inspect.Parameter.empty and k in accepted
    }
    X, y = xy
    assert _in_memory(plan_run(_linear(), (X, y), **{**defaults, "store": tmp_path / "a", "validation": 0.2}))
    lazy = (da.from_array(X, chunks=50), da.from_array(y, chunks=50))
    assert not _in_memory(plan_run(_linear(), lazy, **{**defaults, "store": tmp_path / "b"}))


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((), {"max_epochs": "3"}, TypeError, r"max_epochs must be an integer >= 1, got '3'"),
        (("y",), {}, TypeError, r"fit\(\) takes the training data as one argument.*fit\(model, \(X, y\)\)"),
        ((), {"strings": True}, TypeError, r"data X holds strings \(<U\d+, e\.g\. .*X\.astype\('float32'\)"),
        ((), {"no_params": True}, ValueError, r"the model has no parameters to train \(ReLU holds no"),
    ],
    ids=["max_epochs-str", "sklearn-order", "string-X", "no-parameters"],
)
def test_a_new_users_mistakes_get_the_matching_builtin_and_the_fix(args, kwargs, exc, match, xy, tmp_path):
    """As a scikit-learn user tries it (issue 40): each fails before any cluster work, naming the fix."""
    X, y = xy
    model = torch.nn.ReLU() if kwargs.pop("no_params", False) else _linear()
    if kwargs.pop("strings", False):
        X = X.astype(str)
    data = (X, y) if not args else X
    extra = (y,) if args else ()
    store = tmp_path / "store"
    with pytest.raises(exc, match=match):
        vcdask.fit(model, data, *extra, client=NoCluster(), store=store, progress=False, **kwargs)
    assert not store.exists()


def test_the_data_guides_zarr_examples_pass_the_secret_check():
    """docs/user-guide/data.md's URL examples give storage_options that fit accepts: no credentials in them
    (fit refuses those, so an example holding a key and a secret could never run)."""
    import ast
    import re
    from pathlib import Path

    from vcdask.data import _zarr_source

    text = (Path(__file__).parents[1] / "docs" / "user-guide" / "data.md").read_text()
    calls = [
        node
        for block in re.findall(r"```python\n(.*?)```", text, re.S)
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) == "vcdask.fit"
        and any(k.arg == "storage_options" for k in node.keywords)
    ]
    assert calls, "the data guide shows no storage_options"
    for call in calls:
        url = ast.literal_eval(call.args[1])
        options = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "storage_options"))
        assert _zarr_source(url, options).storage_options == options
    with pytest.raises(DataError, match=r"hold credentials \(\['key', 'secret'\]\)"):
        _zarr_source("s3://bucket/images.zarr", {"key": "K", "secret": "S"})


# -- named features and stored order (xarray / Zarr) ------------------------------------------------------

_WEATHER = ("wind", "temp", "pressure", "hum")  # written in this order; sorted: hum, pressure, temp, wind


def _weather(n=20, order=_WEATHER):
    """One scalar variable per feature, each holding its index in ``_WEATHER`` (a row of X shows the order the
    features were stacked in), written in ``order``; labels ``y`` in 0..2."""
    values = {name: (("s",), np.full(n, _WEATHER.index(name), "float32")) for name in order}
    return xr.Dataset({**values, "y": (("s",), np.arange(n) % 3)})


_SORTED_ROW = [_WEATHER.index(name) for name in sorted(_WEATHER)]  # [3, 2, 1, 0]


def test_zarr_features_are_stacked_sorted_by_name_at_every_opening(tmp_path):
    """An unconsolidated Zarr v3 group lists its variables in an order that changes between openings;
    the inferred features, and so X's columns, come out sorted by name every time, as for the Dataset."""
    from vcdask.data import prepare_data

    path = str(tmp_path / "weather.zarr")
    _weather().to_zarr(path, zarr_format=3, consolidated=False)
    seen = set()
    for _ in range(8):
        prepared = prepare_data(path)
        seen.add(prepared.source.features)
        np.testing.assert_array_equal(prepared.sample_X[0], _SORTED_ROW)
    assert seen == {tuple(sorted(_WEATHER))}
    np.testing.assert_array_equal(prepare_data(_weather()).sample_X[0], _SORTED_ROW)  # in memory: the same


def test_features_named_by_the_caller_keep_the_callers_order(tmp_path):
    from vcdask.data import DataSource, prepare_data

    path = str(tmp_path / "weather.zarr")
    _weather().to_zarr(path, zarr_format=3, consolidated=False)
    named = ["temp", "wind", "pressure"]
    assert prepare_data(path, features=named).source.features == tuple(named)
    np.testing.assert_array_equal(prepare_data(_weather(), features=named).sample_X[0], [1, 0, 2])
    # a spec saved by an earlier version stores its (then unsorted) features: a resume reads them in that order
    earlier = DataSource(path, ("wind", "temp", "pressure", "hum"), "y", "s", 20)
    X, _ = earlier.read(0, 2)
    np.testing.assert_array_equal(X, [[0, 1, 2, 3]] * 2)


def _plan(data, **kwargs):
    from vcdask.options import plan

    torch.manual_seed(0)
    return plan(torch.nn.Linear(kwargs.pop("n_in", 4), 3), data, **kwargs)


@pytest.mark.parametrize("kind", ["dataset", "zarr"])
def test_validation_reads_the_training_features_in_the_training_order(kind, tmp_path):
    """Validation data storing its variables in another order, with one more, is read as training is."""
    train = _weather(order=("temp", "pressure", "wind", "hum"))
    val = _weather(n=10, order=("hum", "wind", "pressure", "temp")).assign(extra=(("s",), np.full(10, 9.0, "f4")))
    if kind == "zarr":
        for name, ds in (("train", train), ("val", val)):
            ds.to_zarr(tmp_path / f"{name}.zarr", zarr_format=3, consolidated=False)
        train, val = str(tmp_path / "train.zarr"), str(tmp_path / "val.zarr")
    checked = _plan(train, validation=val, store=tmp_path / "store")
    if kind == "zarr":
        assert checked.validation.source.features == checked.train.source.features == tuple(sorted(_WEATHER))
    np.testing.assert_array_equal(checked.train.sample_X[0], _SORTED_ROW)
    np.testing.assert_array_equal(checked.validation.sample_X[0], _SORTED_ROW)


def test_validation_of_another_form_reads_the_training_features(tmp_path):
    """xarray training, a DataFrame for validation with its columns in another order (and one more)."""
    columns = ["hum", "extra", "temp", "y", "wind", "pressure"]
    val = _weather(n=10).assign(extra=(("s",), np.full(10, 9.0, "f4"))).to_dataframe()[columns]
    checked = _plan(_weather(), validation=val, store=tmp_path / "store")
    np.testing.assert_array_equal(checked.validation.X[0], _SORTED_ROW)


@pytest.mark.parametrize("kind", ["dataset", "zarr"])
def test_validation_without_a_training_feature_is_refused_naming_it(kind, tmp_path):
    val = _weather(n=10).drop_vars("temp")
    if kind == "zarr":
        val.to_zarr(tmp_path / "val.zarr", zarr_format=3, consolidated=False)
        val = str(tmp_path / "val.zarr")
    with pytest.raises(DataError, match=r"validation: feature variable\(s\) \['temp'\] not in the dataset"):
        _plan(_weather(), validation=val, store=tmp_path / "store")


@pytest.mark.parametrize("lazy", [False, True], ids=["in-memory", "dask-backed"])
def test_xarray_data_is_used_in_stored_order_and_the_last_rows_held_out(lazy, tmp_path):
    n = 20
    ds = xr.Dataset(
        {"x": (("time", "f"), np.arange(n * 2, dtype="float32").reshape(n, 2)), "y": ("time", np.arange(n) % 3)}
    )
    ds = ds.chunk({"time": 5}) if lazy else ds
    checked = _plan(ds, n_in=2, validation=0.2, store=tmp_path / "store")  # shuffle=True, the default
    np.testing.assert_array_equal(np.asarray(checked.train.X)[:, 0], np.arange(16) * 2)
    np.testing.assert_array_equal(np.asarray(checked.validation.X)[:, 0], np.arange(16, 20) * 2)


def test_arrays_and_dataframes_are_still_shuffled(tmp_path):
    n = 20
    X = np.arange(n * 2, dtype="float32").reshape(n, 2)
    y = np.arange(n) % 3
    df = pd.DataFrame({"a": X[:, 0], "b": X[:, 1], "y": y})
    for data in ((X, y), df):
        checked = _plan(data, n_in=2, validation=0.2, store=tmp_path / "store")
        rows = np.concatenate([checked.train.arrays()["X"][:, 0], checked.validation.arrays()["X"][:, 0]])
        assert sorted(rows) == list(np.arange(n) * 2) and list(rows) != list(np.arange(n) * 2)


@pytest.mark.parametrize("classify", [True, False])
def test_bf16_tensors_are_taken_as_float32(classify):
    """Tensors of a dtype NumPy lacks (bfloat16) are data like any other: floating data trains in the
    model's dtype, so float32 loses nothing (they once ended in NumPy's raw ``TypeError``)."""
    from vcdask.data import prepare_data

    X = torch.arange(24, dtype=torch.float32).reshape(12, 2).to(torch.bfloat16)
    y = torch.arange(12) % 3 if classify else torch.linspace(0, 1, 12).to(torch.bfloat16)
    prepared = prepare_data((X, y))
    assert prepared.sample_X.dtype == np.float32 and prepared.classification == classify
    np.testing.assert_array_equal(prepared.sample_X[:2], [[0, 1], [2, 3]])
    assert prepared.y_dtype == (np.int64 if classify else np.float32)


def test_metrics_are_tried_before_any_work_and_a_classifiers_errors_are_of_its_class_ids(xy, tmp_path):
    """A metric that cannot compare the model's outputs with the labels failed the run's first validation,
    after training, without naming the metric; ``"mae"`` on a classifier did (scores per class against class
    ids), though the scheduled jobs' guide offers it for integer labels: it is the error of the predicted
    class ids (ordered classes)."""
    from vcdask.options import mae, mse

    def broken(output, target):
        return float((output - target).abs().mean())  # (n, 10) against (n,): they do not broadcast

    from vcdask.data import prepare_data
    from vcdask.options import accuracy
    from vcdask.preflight import check_model

    prepared = prepare_data(xy)
    message = r"metric 'broken' cannot compare model outputs of shape \(\d+, 10\)"
    with pytest.raises(DataError, match=message):  # one of vcdask's: refused
        check_model(
            _linear(),
            prepared,
            torch.nn.functional.cross_entropy,
            True,
            torch.float32,
            metrics={"broken": broken},
            strict=["broken"],
        )
    with pytest.warns(UserWarning, match=message + r".*on these 4 rows only"):  # the user's: said
        fit_metrics = {"accuracy": accuracy, "broken": broken}
        check_model(_linear(), prepared, torch.nn.functional.cross_entropy, True, torch.float32, metrics=fit_metrics)
    scores = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.0, 0.2, 0.7]])
    labels = torch.tensor([1, 2, 0])  # predicted 1, 0, 2
    assert mae(scores, labels) == pytest.approx((0 + 2 + 2) / 3) and mse(scores, labels) == pytest.approx(8 / 3)
    assert mae(torch.tensor([[1.0], [3.0]]), torch.tensor([2.0, 2.0])) == 1.0  # a regression's, as before
