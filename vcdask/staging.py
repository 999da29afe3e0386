"""Putting prepared data where the workers read it: in-memory and dask data staged as a Zarr group in
the run's folder of the parameter store, and the seeded shuffle and validation split before that."""

from __future__ import annotations

import copy

import numpy as np

from .data import DataSource, PreparedData, _is_dask

__all__ = ["in_memory", "split", "stage"]


def stage(prepared: PreparedData, files, path: str, *, client=None, sample_dim: str = "sample") -> DataSource:
    """Write in-memory or dask ``(X, y)`` as a Zarr group at ``<store>/runs/<path>``; return its source.

    ``files`` is the parameter store's :attr:`~vcdask.store.ParamStore.files`.  dask arrays are
    written by the workers of ``client`` (``to_zarr``), not through this process; the graph and
    the returned source carry the store (which pickles without secrets), never credentials.
    """
    import xarray as xr

    columns = prepared.columns if prepared.form == "dict" else {"X": prepared.X, "y": prepared.y}
    assert columns is not None
    ds = xr.Dataset({k: ((sample_dim, *[f"{k}_dim_{i}" for i in range(1, a.ndim)]), a) for k, a in columns.items()})
    lazy = any(_is_dask(a) for a in columns.values())
    rows = min(_rows_per_chunk(a) for a in columns.values())
    target = files.zarr_store(path)
    if lazy:
        ds = ds.chunk({sample_dim: rows})
    encoding = None if lazy else {k: {"chunks": (rows,) + ds[k].shape[1:]} for k in columns}
    if lazy and client is not None:  # the workers write their chunks
        client.compute(ds.to_zarr(target, mode="w", consolidated=False, zarr_format=3, compute=False)).result()
    else:
        ds.to_zarr(target, mode="w", consolidated=False, zarr_format=3, encoding=encoding)
    if prepared.form == "dict":
        names = tuple(columns)
        return DataSource(files.url(path), names, "", sample_dim, prepared.n, store=files.store, path=path, form="dict")
    return DataSource(files.url(path), ("X",), "y", sample_dim, prepared.n, store=files.store, path=path)


def in_memory(prepared: PreparedData) -> bool:
    """Whether :func:`stage` writes ``prepared`` from this process (no dask array among its columns)."""
    columns = prepared.columns if prepared.form == "dict" else {"X": prepared.X, "y": prepared.y}
    return columns is not None and not any(_is_dask(a) for a in columns.values())


def _rows_per_chunk(X) -> int:
    row_bytes = max(1, int(np.prod(X.shape[1:])) * np.dtype(X.dtype).itemsize)
    return max(1, min(int(X.shape[0]), (4 << 20) // row_bytes))


def split(
    prepared: PreparedData, validation: float | None, seed: int, shuffle: bool
) -> tuple[PreparedData, PreparedData | None]:
    """Shuffle numpy data once (seeded) when ``shuffle`` and split off a ``validation`` fraction (the last rows).

    dask and Zarr data keep their stored order; the caller passes ``shuffle=False`` for numpy data that
    came from an xarray Dataset (:func:`~vcdask.data.stored_order`).
    """
    rng = np.random.default_rng(seed)
    if prepared.form == "dict" and prepared.columns is not None:
        cols = prepared.columns
        if shuffle and all(isinstance(a, np.ndarray) for a in cols.values()):
            order = rng.permutation(prepared.n)
            prepared.columns = {k: a[order] for k, a in cols.items()}
    elif prepared.source is None and shuffle and isinstance(prepared.X, np.ndarray):
        order = rng.permutation(prepared.n)
        prepared.X, prepared.y = prepared.X[order], prepared.y[order]
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
    if prepared.form == "dict":
        assert prepared.columns is not None
        train.columns = {k: a[:n_train] for k, a in prepared.columns.items()}
        val.columns = {k: a[n_train:] for k, a in prepared.columns.items()}
        train.n, val.n = n_train, n_val
        return train, val
    train.X, train.y, train.n = prepared.X[:n_train], prepared.y[:n_train], n_train
    val.X, val.y, val.n = prepared.X[n_train:], prepared.y[n_train:], n_val
    return train, val
