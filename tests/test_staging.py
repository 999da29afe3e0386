"""Staging in-memory rows: the seeded shuffle and the validation split copy nothing; the rows are gathered a chunk
at a time as they are written (the shuffle made a copy of all of them, which the run then kept)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import xarray as xr

import vcdask
from vcdask.data import prepare_data
from vcdask.staging import split, stage


def _read(store, path):
    return xr.open_zarr(store.files.zarr_store(path), consolidated=False, zarr_format=3)


@pytest.mark.parametrize("form", ["xy", "dict"])
def test_the_shuffled_split_rows_are_staged_as_the_seeded_order_says(form, tmp_path):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(1000, 300)).astype("float32")  # (1.2 kB a row: 3,495 rows a 4 MiB chunk, more than n)
    y = rng.integers(0, 5, size=1000)
    data = (X, y) if form == "xy" else {"X": X, "y": y}
    train, val = split(prepare_data(data), 0.25, seed=7, shuffle=True)
    order = np.random.default_rng(7).permutation(1000)
    assert train.n == 750 and val.n == 250 and train.order is not None
    store = vcdask.open_store(tmp_path / "s")
    for part, path, rows in ((train, "r/train.zarr", order[:750]), (val, "r/validation.zarr", order[750:])):
        stage(part, store.files, path)
        staged = _read(store, path)
        np.testing.assert_array_equal(staged["X"].values, X[rows])
        np.testing.assert_array_equal(staged["y"].values, y[rows])
        np.testing.assert_array_equal(part.arrays()["X"], X[rows])


def test_staging_shuffled_rows_holds_a_chunk_of_them_not_a_copy_of_all(tmp_path):
    X = np.random.default_rng(0).normal(size=(64_000, 128)).astype("float32")  # 32 MiB: 8 chunks of 4 MiB
    y = np.arange(64_000) % 10
    store = vcdask.open_store(tmp_path / "s")
    prepared = prepare_data((X, y))
    tracemalloc.start()
    try:
        train, val = split(prepared, 0.1, seed=0, shuffle=True)
        stage(train, store.files, "r/train.zarr")
        stage(val, store.files, "r/validation.zarr")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.0 * X.nbytes, f"{peak / X.nbytes:.2f}x the rows"  # (3.2x: a shuffled copy, then more)
    order = np.random.default_rng(0).permutation(64_000)
    np.testing.assert_array_equal(_read(store, "r/train.zarr")["X"].values[:5], X[order[:5]])


def test_wider_floating_columns_are_stored_in_the_models_dtype(tmp_path):
    """A DataFrame's float64 for a float32 model was staged as float64 (twice the bytes to write, store and read)
    and cast on every worker: it is stored as the workers train on it; integer labels and narrower columns stay."""
    import torch

    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(500, 6)), rng.normal(size=500)  # (float64 regression)
    ids = rng.integers(0, 3, size=500)
    store = vcdask.open_store(tmp_path / "s")
    train, _ = split(prepare_data((X, y)), None, seed=3, shuffle=True)
    stage(train, store.files, "r/reg.zarr", dtype=torch.float32)
    staged = _read(store, "r/reg.zarr")
    order = np.random.default_rng(3).permutation(500)
    assert staged["X"].dtype == np.float32 and staged["y"].dtype == np.float32
    np.testing.assert_array_equal(staged["X"].values, X[order].astype(np.float32))
    np.testing.assert_array_equal(staged["y"].values, y[order].astype(np.float32))
    stage(prepare_data((X.astype(np.float32), ids)), store.files, "r/cls.zarr", dtype=torch.float64)
    staged = _read(store, "r/cls.zarr")
    assert staged["X"].dtype == np.float32 and staged["y"].dtype == ids.dtype  # (never widened; ids as they are)
