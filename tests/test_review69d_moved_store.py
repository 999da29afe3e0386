"""A store copied or moved elsewhere (``cp -r``, ``mv``, a tar round trip) is a store of its own: a run's spec read
from it is bound to it, so loading and resuming there never reads, writes or creates anything where the store
was (a resumed copy wrote its versions into the original; a moved store could not be loaded nor resumed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
import xarray as xr
from distributed import Client, LocalCluster

import vcdask
from vcdask.data import DataSource, Shards, prepare_data
from vcdask.spec import RunSpec, load_spec, loads, save_spec, spec_path
from vcdask.staging import stage


def _data(n=180, seed=1):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 5)).astype("float32")
    return X, (X[:, 0] > X[:, 1]).astype("int64")


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _spec(store, run_id: str, train: DataSource, validation: DataSource | None) -> RunSpec:
    return RunSpec(
        run_id=run_id,
        store=store,
        branch=run_id,
        model=torch.nn.Linear(2, 3),
        loss=torch.nn.functional.cross_entropy,
        optimizer=torch.optim.SGD,
        local_epochs=1,
        batch_size=4,
        seed=0,
        train=train,
        shards=Shards(train.n, 2),
        validation=validation,
        metrics={},
        classification=True,
        x_dtype=torch.float32,
        max_epochs=1,
        merge=None,
        target=None,
        commit_every=1,
        validate_every=1,
    )


# -- the spec: bound to the store it is read from, opening nothing where it was written ----------------------------
def test_a_spec_read_from_a_moved_store_is_bound_to_it_and_its_old_place_is_never_opened(tmp_path, monkeypatch):
    X, y = np.arange(40, dtype=np.float32).reshape(20, 2), np.arange(20) % 3
    own = tmp_path / "own.zarr"  # data of the user's own, read where it lives: it keeps its URL
    ds = xr.Dataset({"X": (("sample", "f"), X[:5]), "y": (("sample",), y[:5])})
    ds.to_zarr(own, zarr_format=3, consolidated=False)
    orig = vcdask.open_store(tmp_path / "orig")
    orig.create_branch("run-1")
    train = stage(prepare_data((X, y)), orig.files, "run-1/train.zarr")
    save_spec(_spec(orig, "run-1", train, DataSource(str(own), ("X",), "y", "sample", 5)))
    os.rename(tmp_path / "orig", tmp_path / "moved")

    moved = vcdask.open_store(tmp_path / "moved", mode="r")
    spec = load_spec(moved, "run-1")
    assert spec.store is moved
    assert spec.train.store is moved and spec.train.url == moved.files.url("run-1/train.zarr")
    rows_X, rows_y = spec.train.read(3, 6)  # the staged rows, read where the store is now
    assert np.array_equal(rows_X, X[3:6]) and np.array_equal(rows_y, y[3:6])
    assert spec.validation.store is None and spec.validation.url == str(own)
    assert np.array_equal(spec.validation.read(0, 2)[0], X[:2])
    # the bytes, unpickled without a store, name where the spec was written, and opening it is not tried (in a
    # process that has not unpickled that store before: this one did, dask's tokens of the staged Zarr pickle it)
    from vcdask.store import _copies

    monkeypatch.setattr(_copies, "_reopened", type(_copies._reopened)())
    written = loads(moved.files.get(spec_path("run-1")))
    assert written.store.location == orig.location and "not opened yet" in repr(written.store)
    assert not (tmp_path / "orig").exists()


# -- whole runs: copied, moved, packed and unpacked -----------------------------------------------------------------
def test_a_copy_of_a_store_resumes_in_the_copy_and_the_original_is_left_as_it_was(client, tmp_path):
    X, y = _data()
    torch.manual_seed(0)
    first = vcdask.fit(
        torch.nn.Linear(5, 2), (X, y), max_epochs=1, n_shards=4, retention=False, client=client,
        store=tmp_path / "orig", progress=False,
    )  # fmt: skip
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    before = _snapshot(tmp_path / "orig")

    more = vcdask.resume(first.run_id, store=tmp_path / "copy", client=client, max_epochs=2, progress=False)
    copy = vcdask.open_store(tmp_path / "copy", mode="r")
    assert more.store.location == copy.location
    assert [v.metadata["step"] for v in copy.versions(first.run_id)] == list(range(8, -1, -1))
    assert _snapshot(tmp_path / "orig") == before  # not a byte written there (its versions end at step 4)
    assert [v.metadata["step"] for v in first.store.versions(first.run_id)] == [4, 3, 2, 1, 0]
    spec = loads(copy.files.get(spec_path(first.run_id)))  # the spec the copy keeps names the copy now
    assert spec.max_epochs == 2 and spec.store.location == copy.location
    assert spec.train.url == copy.files.url(f"{first.run_id}/train.zarr")


_LOAD_IN_A_FRESH_PROCESS = """
import sys, vcdask
model = vcdask.load(sys.argv[1], branch=sys.argv[2])
print(model.vcdask_version["step"], type(model).__name__)
"""


def test_a_run_whose_scheduler_died_loads_and_resumes_where_its_store_was_moved(client, tmp_path):
    """Packed with tar, unpacked elsewhere and the original deleted: the run loads in a fresh process (it said the
    spec was gone: the spec reopened the store where it had been written) and resumes there, every (epoch, shard)
    merged once, and nothing is made where the store was (it made that store's spec and record again)."""
    X, y = _data(n=240)
    torch.manual_seed(0)
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as there,
        Client(there, set_as_default=False) as c,
    ):
        handle = vcdask.fit(
            torch.nn.Linear(5, 2), (X, y), max_epochs=30, n_shards=4, batch_size=1, local_epochs=5, retention=False,
            client=c, store=tmp_path / "orig", wait=False, progress=False,
        )  # fmt: skip
        orig = vcdask.open_store(tmp_path / "orig", mode="r")
        deadline = time.monotonic() + 120
        while orig.head(handle.run_id) is None or orig.read(branch=handle.run_id).metadata["step"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    # its scheduler closed under it: the run stopped part way
    epochs = vcdask.extend.epochs_done(orig, handle.run_id)
    assert epochs < 30
    with tarfile.open(tmp_path / "store.tar", "w") as tar:
        tar.add(tmp_path / "orig", arcname="store")
    shutil.rmtree(tmp_path / "orig")
    with tarfile.open(tmp_path / "store.tar") as tar:
        tar.extractall(tmp_path / "elsewhere", filter="data")
    where = tmp_path / "elsewhere" / "store"
    step = vcdask.open_store(where, mode="r").read(branch=handle.run_id).metadata["step"]

    loaded = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS, str(where), handle.run_id],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == [str(step), "Linear"]

    more = vcdask.resume(handle.run_id, store=where, client=client, max_epochs=epochs + 1, progress=False)
    moved = vcdask.open_store(where, mode="r")
    assert more.store.location == moved.location
    versions = moved.versions(handle.run_id)
    assert [v.metadata["step"] for v in versions] == list(range(4 * (epochs + 1), -1, -1))
    merged = sorted((e, s) for v in versions for e, s, _ in v.metadata["merged"])
    assert merged == [(e, s) for e in range(1, epochs + 2) for s in range(4)]  # each once
    assert not (tmp_path / "orig").exists()
