"""A relative Zarr path ("data.zarr") was read against this process's working directory by fit's checks, and
against the workers' by the tasks: after an os.chdir (Jupyter's %cd) every task failed FileNotFoundError on the
old directory.  The path is made absolute when fit is called, as the store's path is."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

import vcdask
from vcdask.data import _absolute
from vcdask.options import plan


def _zarr(path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 3)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    xr.Dataset({"x": (("sample", "f"), x), "y": (("sample",), y)}).to_zarr(path, zarr_format=3, consolidated=False)


def test_a_relative_zarr_path_is_read_where_fit_was_called_from(tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    _zarr(tmp_path / "here" / "data.zarr")
    monkeypatch.chdir(tmp_path / "here")
    where = str(tmp_path / "here" / "data.zarr")
    planned = plan(torch.nn.Linear(3, 2), "data.zarr", validation=0.25, store=tmp_path / "s")
    assert planned.train.source.url == where and planned.validation.source.url == where
    by_url = plan(torch.nn.Linear(3, 2), "file://data.zarr", validation="data.zarr", store=tmp_path / "s")
    assert by_url.train.source.url == f"file://{where}" and by_url.validation.source.url == where
    monkeypatch.chdir(tmp_path)  # (a worker's directory is another: the rows are still there)
    X, y = planned.train.source.read(0, 4)
    assert X.shape == (4, 3) and y.shape == (4,)
    assert by_url.train.source.read(0, 4)[0].shape == (4, 3)


@pytest.mark.parametrize("url", ["s3://bucket/data.zarr", "gs://b/d.zarr", "simplecache::s3://b/d.zarr"])
def test_a_url_of_another_filesystem_is_kept_as_given(url):
    assert _absolute(url) == url


def test_a_run_on_a_relative_zarr_path_trains_after_a_change_of_directory(cluster, tmp_path, monkeypatch):
    """The reviewer's run: the workers (processes started in another directory) read the path fit was given."""
    (tmp_path / "here").mkdir()
    _zarr(tmp_path / "here" / "data.zarr")
    monkeypatch.chdir(tmp_path / "here")
    kw = dict(max_epochs=1, n_shards=2, client=cluster[1], store=tmp_path / "s", progress=False)
    result = vcdask.fit(torch.nn.Linear(3, 2), "data.zarr", validation=0.25, **kw)
    assert len(result.epochs) == 1 and result.epochs["skipped"].iloc[0] == 0
