"""Putting prepared data where the workers read it: in-memory and dask data staged as a Zarr group in
the run's folder of the parameter store, and the seeded shuffle and validation split before that."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from .data import DataSource, PreparedData, _is_dask

__all__ = ["in_memory", "split", "stage"]


def stage(
    prepared: PreparedData, files, path: str, *, client=None, sample_dim: str = "sample", dtype: Any = None
) -> DataSource:
    """Write in-memory or dask ``(X, y)`` as a Zarr group at ``<store>/runs/<path>``; return its source.

    ``files`` is the parameter store's :attr:`~vcdask.store.ParamStore.files`.  dask arrays are
    written by the workers of ``client`` (``to_zarr``), not through this process; the graph and
    the returned source carry the store (which pickles without secrets), never credentials.
    ``dtype``: the model's floating dtype (the run's ``x_dtype``), which the workers cast floating columns to
    (:func:`~vcdask.batches.cast_like_training`): wider floating columns are stored in it (a DataFrame's
    float64 for a float32 model: half the bytes to write, store and read, the same values trained on).
    """
    import dask
    import xarray as xr

    columns = prepared.columns if prepared.form == "dict" else {"X": prepared.X, "y": prepared.y}
    assert columns is not None
    narrow = {k: _narrowed(a, dtype) for k, a in columns.items()}
    rows = min(_rows_per_chunk(a, narrow[k]) for k, a in columns.items())
    here = not any(_is_dask(a) for a in columns.values())
    if here:  # (this process's rows, written a chunk at a time: shuffled or split ones gathered as they are)
        columns = {k: _chunked(a, prepared.order, rows) for k, a in columns.items()}
    columns = {k: a if narrow[k] is None else a.astype(narrow[k]) for k, a in columns.items()}  # (a chunk at a time)
    ds = xr.Dataset({k: ((sample_dim, *[f"{k}_dim_{i}" for i in range(1, a.ndim)]), a) for k, a in columns.items()})
    target = files.zarr_store(path)
    ds = ds.chunk({sample_dim: rows})
    if not here and client is not None:  # the workers write their chunks
        client.compute(ds.to_zarr(target, mode="w", consolidated=False, zarr_format=3, compute=False)).result()
    else:  # (by this process's threads, never a default Client's cluster)
        with dask.config.set(scheduler="threads"):
            ds.to_zarr(target, mode="w", consolidated=False, zarr_format=3)
    if prepared.form == "dict":
        names = tuple(columns)
        return DataSource(files.url(path), names, "", sample_dim, prepared.n, store=files.store, path=path, form="dict")
    return DataSource(files.url(path), ("X",), "y", sample_dim, prepared.n, store=files.store, path=path)


def in_memory(prepared: PreparedData) -> bool:
    """Whether :func:`stage` writes ``prepared`` from this process (no dask array among its columns)."""
    columns = prepared.columns if prepared.form == "dict" else {"X": prepared.X, "y": prepared.y}
    return columns is not None and not any(_is_dask(a) for a in columns.values())


def _chunked(a: np.ndarray, order: np.ndarray | None, rows: int):
    """``a`` (``a[order]``) as a dask array of ``rows``-row blocks, each a view of ``a`` (gathered) when it is
    computed: staging writes the rows a chunk at a time, without a copy of them all (a shuffled copy, then
    xarray's own of the whole arrays: split and stage of 32 MiB of rows allocated 3.2x them at their peak, 2.3x
    unshuffled)."""
    import dask
    import dask.array as da

    if order is None:
        return da.from_array(a, chunks=(rows, *a.shape[1:]), name=False)  # (name=False: no hash of all the rows)
    take = dask.delayed(np.take, pure=False)
    blocks = [
        da.from_delayed(
            take(a, order[i : i + rows], axis=0), shape=(len(order[i : i + rows]), *a.shape[1:]), dtype=a.dtype
        )
        for i in range(0, len(order), rows)
    ]
    return da.concatenate(blocks, axis=0)


def _narrowed(a, dtype: Any) -> np.dtype | None:
    """The dtype a floating column ``a`` is stored in for a model of floating ``dtype`` (a torch or NumPy dtype):
    that one where it is narrower than ``a``'s; None to store ``a`` as it is."""
    if dtype is None or np.dtype(a.dtype).kind != "f":
        return None
    target = np.dtype(str(dtype).removeprefix("torch."))
    return target if target.kind == "f" and target.itemsize < np.dtype(a.dtype).itemsize else None


def _rows_per_chunk(X, dtype: Any = None) -> int:
    itemsize = np.dtype(X.dtype if dtype is None else dtype).itemsize
    row_bytes = max(1, int(np.prod(X.shape[1:])) * itemsize)
    return max(1, min(int(X.shape[0]), (4 << 20) // row_bytes))


def split(
    prepared: PreparedData, validation: float | None, seed: int, shuffle: bool
) -> tuple[PreparedData, PreparedData | None]:
    """Shuffle numpy data once (seeded) when ``shuffle`` and split off a ``validation`` fraction (the last rows).

    A shuffle copies nothing: it sets ``prepared.order``, the rows' order, which :func:`stage` gathers a chunk at
    a time; the validation split gives each part its share of it.

    dask and Zarr data keep their stored order; the caller passes ``shuffle=False`` for numpy data that
    came from an xarray Dataset (:func:`~vcdask.data.stored_order`).
    """
    rng = np.random.default_rng(seed)
    if prepared.form == "dict" and prepared.columns is not None:
        if shuffle and all(isinstance(a, np.ndarray) for a in prepared.columns.values()):
            prepared.order = rng.permutation(prepared.n)
    elif prepared.source is None and shuffle and isinstance(prepared.X, np.ndarray):
        prepared.order = rng.permutation(prepared.n)
    if not isinstance(validation, float):
        return prepared, None
    n_val = max(1, int(round(prepared.n * validation)))
    if n_val >= prepared.n:
        raise ValueError(f"validation={validation} leaves no training samples out of {prepared.n}")
    n_train = prepared.n - n_val
    if prepared.source is not None:
        train = copy.copy(prepared)
        train.source, train.n = prepared.source.slice(0, n_train), n_train
        val = copy.copy(prepared)
        val.source, val.n = prepared.source.slice(n_train, prepared.n), n_val
        return train, val
    train, val = copy.copy(prepared), copy.copy(prepared)
    if prepared.order is not None:  # (the rows as they are; each part stages its share of the shuffled order)
        train.order, val.order = prepared.order[:n_train], prepared.order[n_train:]
        train.n, val.n = n_train, n_val
        return train, val
    if prepared.form == "dict":
        assert prepared.columns is not None
        train.columns = {k: a[:n_train] for k, a in prepared.columns.items()}
        val.columns = {k: a[n_train:] for k, a in prepared.columns.items()}
        train.n, val.n = n_train, n_val
        return train, val
    train.X, train.y, train.n = prepared.X[:n_train], prepared.y[:n_train], n_train
    val.X, val.y, val.n = prepared.X[n_train:], prepared.y[n_train:], n_val
    return train, val
