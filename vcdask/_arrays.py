"""Arrays as data: ``(X, y)`` arrays and dicts of arrays, numpy, torch or dask, checked and described as
:class:`~vcdask.prepared.PreparedData`, for :func:`vcdask.data.prepare_data`.

The labels keep the shape they are given, class ids as a column ``y`` (n, 1) too (a ``train_step`` of one's
own may be written for it; the default cross-entropy's refusal of them says to pass ``y.ravel()``).

Each is refused with what to do when it is empty, has no sample axis, lengths that differ or dask chunks of
unknown size; only the first rows (and the range of integer labels) are read, dask's computed where the caller's
``scheduler`` computes.  Below :mod:`vcdask.data`, which dispatches the inputs here and re-exports
:func:`_is_dask` for :mod:`vcdask.staging`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import DataError
from .prepared import PreparedData


def _prepare_xy(data: Any, what: str, scheduler: Any = None) -> PreparedData:
    """``(X, y)`` arrays (numpy, torch or dask): checked, their first rows read (and the labels' range, of
    integer labels), dask's where ``scheduler`` computes (see :func:`vcdask.data.prepare_data`)."""
    if len(data) != 2:
        several = (
            "; for several inputs, pass a dict of equal-length arrays, {'a': X1, 'b': X2, 'y': y}, with "
            "train_step=fn(model, batch) that reads them (model(batch['a'], batch['b']) against batch['y'])"
            if len(data) > 2
            else ""
        )
        raise DataError(f"{what} as a sequence must be (X, y), got {len(data)} items{several}")
    X, y = data
    if _is_dask(X) or _is_dask(y):
        import dask.array as da

        X, y = da.asarray(X), da.asarray(y)
        if any(math.isnan(s) for s in (*X.shape, *y.shape)):
            raise DataError(f"{what}: dask arrays with unknown chunk sizes; call .compute_chunk_sizes() first")
    else:
        X, y = _as_numpy(X, f"{what} X"), _as_numpy(y, f"{what} y")
    if X.ndim == 0 or y.ndim == 0:
        raise DataError(f"{what}: X and y need a sample axis; got shapes {X.shape} and {y.shape}")
    if X.shape[0] != y.shape[0]:
        raise DataError(f"{what}: X has {X.shape[0]} samples but y has {y.shape[0]}; they must match")
    if X.shape[0] == 0:
        raise DataError(f"{what} is empty (0 samples)")
    head = slice(0, min(4, X.shape[0]))
    ranged = (y.min(), y.max()) if np.issubdtype(y.dtype, np.integer) else (None, None)
    if _is_dask(X):  # (both are: the first rows and the labels' range in one pass, where scheduler computes)
        import dask

        sx, sy, lo, hi = dask.compute(X[head], y[head], *ranged, scheduler=scheduler)
    else:
        sx, sy, (lo, hi) = X[head], y[head], ranged
    sx, sy = np.array(sx), np.array(sy)  # (copies: a read-only array's rows would make torch warn)
    return PreparedData(
        None,
        X,
        y,
        int(X.shape[0]),
        tuple(X.shape[1:]),
        X.dtype,
        y.dtype,
        sx,
        sy,
        None if lo is None else int(lo),
        None if hi is None else int(hi),
    )


def _prepare_dict(data: Mapping, what: str, scheduler: Any = None) -> PreparedData:
    """Dict data: equal-length arrays, one per input (each batch a dict of tensors)."""
    if not data:
        raise DataError(f"{what} as a dict needs at least one array")
    columns: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise DataError(f"{what}: dict keys must be non-empty strings without '/', got {key!r}")
        a = value.data if type(value).__module__.startswith("xarray") else value
        a = a if _is_dask(a) else _as_numpy(a, f"{what}[{key!r}]")
        if a.ndim == 0:
            raise DataError(f"{what}[{key!r}] needs a sample axis; got a scalar")
        columns[key] = a
    lengths = {k: a.shape[0] for k, a in columns.items()}
    if len(set(lengths.values())) != 1:
        raise DataError(f"{what}: the arrays must have equal lengths (one row per sample), got {lengths}")
    n = next(iter(lengths.values()))
    if n == 0 or any(math.isnan(s) for a in columns.values() for s in a.shape):
        raise DataError(f"{what} is empty (0 samples) or has unknown chunk sizes")
    heads = {k: a[: min(4, n)] for k, a in columns.items()}
    if any(_is_dask(a) for a in heads.values()):
        import dask

        (heads,) = dask.compute(heads, scheduler=scheduler)
    sample = {k: np.array(a) for k, a in heads.items()}  # (copies, writable, as above)
    return PreparedData(None, n=int(n), form="dict", columns=columns, sample=sample)


def _as_numpy(a: Any, what: str) -> np.ndarray:
    import torch

    if isinstance(a, torch.Tensor):
        from .torch_data import cpu_numpy

        return cpu_numpy(a)
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "__array__") and not _is_dask(a):
        return np.asarray(a)
    raise DataError(f"{what} must be a numpy array, torch tensor or dask array, got {type(a).__name__}")


def _is_dask(a: Any) -> bool:
    return type(a).__module__.startswith("dask.array") or hasattr(a, "__dask_graph__")
