"""NaN and inf in the data are refused before any cluster work, naming the array, the count and the
first bad index (vcdask.finite; issue 40)."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import torch
import xarray as xr
from refusal_helpers import NoCluster

import vcdask
from vcdask import finite
from vcdask.data import DataError


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6, 3))


@pytest.fixture
def xy():
    rng = np.random.default_rng(0)
    return rng.random((200, 2, 3), dtype=np.float32), rng.integers(0, 3, 200)


def _refused(data, tmp_path, match, **kw):
    store = tmp_path / "store"
    with pytest.raises(DataError, match=match) as info:
        vcdask.fit(_model(), data, client=NoCluster(), store=store, progress=False, **kw)
    assert not store.exists(), "the store was created before the input was rejected"
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_nan_and_inf_in_numpy_x_are_named_with_count_and_first_index(xy, tmp_path):
    X, y = xy
    X[17, 1, 2], X[150, 0, 0], X[151, 0, 1] = np.nan, np.inf, -np.inf
    message = _refused((X, y), tmp_path, r"data X has 3 non-finite value\(s\) \(NaN or inf\); the first at sample 17")
    assert "index [17, 1, 2]" in message and "np.nan_to_num" in message


def test_nan_labels_torch_tensors_dict_and_validation_data(xy, tmp_path):
    X, y = xy
    yf = y.astype(np.float32)
    yf[5] = np.nan
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6, 1))
    with pytest.raises(DataError, match=r"data y has 1 non-finite value\(s\).*sample 5"):
        vcdask.fit(model, (X, yf), client=NoCluster(), store=tmp_path / "a", progress=False, loss="mse")
    Xt = torch.from_numpy(X.copy())
    Xt[3, 0, 0] = float("inf")
    _refused((Xt, torch.from_numpy(y)), tmp_path, r"data X has 1 non-finite value\(s\).*sample 3")
    bad_val = X[:20].copy()
    bad_val[19, 1, 1] = np.nan
    _refused((X, y), tmp_path, r"validation X has 1 non-finite.*sample 19", validation=(bad_val, y[:20]))
    columns = {"x": X.copy(), "y": y}
    columns["x"][0, 0, 0] = np.nan
    with pytest.raises(DataError, match=r"data\['x'\] has 1 non-finite value\(s\).*sample 0"):
        vcdask.fit(
            _model(), columns, train_step=lambda m, b: m(b["x"]).sum(), client=NoCluster(), store=tmp_path / "b",
            progress=False,
        )  # fmt: skip


def test_dask_and_zarr_data_are_checked_chunk_by_chunk(xy, tmp_path):
    X, y = xy
    X = X.copy()
    X[123, 1, 0] = np.nan
    from vcdask.options import plan

    def refused(data, match, **kw):  # (planned without a client: dask's threads scan it here, before any cluster)
        store = tmp_path / "store"
        with pytest.raises(DataError, match=match) as info:
            plan(_model(), data, store=store, **kw)
        assert not store.exists() and isinstance(info.value, ValueError)

    lazy = da.from_array(X, chunks=(50, 2, 3))
    refused((lazy, da.from_array(y, chunks=50)), r"data X has 1 non-finite.*sample 123 \(index \[123, 1, 0\]\)")
    ds = xr.Dataset({"x": (("sample", "a", "b"), X), "label": (("sample",), y)})
    ds.to_zarr(tmp_path / "data.zarr", encoding={"x": {"chunks": (40, 2, 3)}}, consolidated=False)
    refused(str(tmp_path / "data.zarr"), r"data variable 'x' has 1 non-finite.*sample 123", label="label")


def test_integer_data_and_clean_floats_pass_and_blocks_cover_every_row(monkeypatch):
    assert finite.first_non_finite(np.arange(10)) == (0, None)  # integers hold no NaN
    assert finite.first_non_finite(np.ones((5, 3))) == (0, None)
    monkeypatch.setattr(finite, "BLOCK_BYTES", 24)  # one row of 3 float64s per block
    a = np.zeros((7, 3))
    a[4, 2] = a[6, 0] = np.nan
    assert finite.first_non_finite(a) == (2, (4, 2))
    assert finite.first_non_finite(da.from_array(a, chunks=2)) == (2, (4, 2))


class _Rows(torch.utils.data.Dataset):
    """Map-style, NaN in samples ``bad`` on: the run's probe (the first samples) sees none."""

    def __init__(self, X, y, bad: int):
        self.X, self.y = X.copy(), y
        self.X[bad:] = np.nan

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return torch.from_numpy(self.X[i]), int(self.y[i])


@pytest.mark.parametrize("on_shard_failure", ["skip", "stop"])
def test_a_shard_non_finite_on_two_workers_blames_its_data_not_the_workers(client, xy, tmp_path, on_shard_failure):
    """A shard whose updates come back NaN from two workers is given up at once, its samples named, and
    neither worker is counted a fault (the first is forgiven): before, every copy was rejected, each
    worker blamed and excluded in turn, and the run failed without a word about the data."""
    X, y = xy
    kw = {"n_shards": 4, "max_epochs": 2, "client": client, "store": tmp_path / "s", "progress": False}
    res = vcdask.Resilience(on_shard_failure=on_shard_failure, max_worker_failures=2)
    if on_shard_failure == "stop":
        with pytest.raises(vcdask.RunFailedError, match=r"non-finite \(NaN/inf\) on 2 workers .*samples 150-199"):
            vcdask.fit(_model(), _Rows(X, y, bad=150), resilience=res, **kw)
        return
    result = vcdask.fit(_model(), _Rows(X, y, bad=150), resilience=res, **kw)
    h = result.history
    skipped = h[h.outcome == "skipped"]
    assert sorted(skipped.epoch) == [1, 2] and set(skipped.shard) == {3}
    assert skipped.reason.str.contains("samples 150-199").all()
    rejected = h[h.outcome == "rejected"]
    assert set(rejected.shard) == {3} and rejected.reason.str.contains("non-finite").all()
    assert rejected.worker.nunique() == 2  # once on each worker: the data is blamed
    # one epoch's copies came back NaN on both workers, the other's (known for the data's) was given up at its
    # first; as epochs overlap, the second NaN may be the next epoch's: then both are given up at their first
    assert sorted(set(rejected.epoch)) == [1, 2] and len(rejected) <= 3, rejected
    assert set(h[h.outcome.isin(["late", "cancelled"])].shard) <= {3}  # a retry out meanwhile, turned down
    workers = result.workers.set_index("worker")
    assert (workers.rejected == 0).all() and workers.excluded.isna().all(), workers
    assert len(h[h.outcome == "merged"]) == 6  # every other shard of both epochs
