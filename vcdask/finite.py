"""Finite checks of training and validation data before any cluster work.

A NaN or an inf in the inputs or labels makes every update of its shard non-finite: the run would
reject them, blame healthy workers for them and fail without naming the data (issue 40).  As
scikit-learn's ``check_array`` does, :func:`check_finite` refuses such data up front and says which
array, how many values and where the first is.

Numpy arrays are checked in blocks of rows (no copy of the whole array); dask arrays (and Zarr /
xarray data, read through dask) in one pass over their chunks, by the ``scheduler`` given (``fit``'s: the cluster
of its ``client=``, :func:`vcdask.options.plan`).  Integer and boolean arrays hold no
NaN and are skipped.  A ``torch.utils.data.Dataset`` is checked on the batch the run probes (reading
every sample of an arbitrary dataset is not cheap): a NaN further in shows up as rejected updates.

Floating values are cast to the model's dtype for training: float64 values beyond float32's range
(``1e39``) would become inf there, so, given that dtype, they are refused the same way, in the same pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import DataError

if TYPE_CHECKING:
    from .prepared import PreparedData

__all__ = ["BLOCK_BYTES", "check_finite", "first_non_finite", "scan"]

#: Bytes of a numpy array checked at a time (one boolean mask of this many elements at most).
BLOCK_BYTES = 64 * 2**20


def _floating(a: Any) -> bool:
    kind = np.dtype(getattr(a, "dtype", np.float64)).kind
    return kind in "fc"


Found = tuple[int, tuple[int, ...] | None]  # how many values, and the index of the first (None: none)


def first_non_finite(a: Any, scheduler: Any = None) -> Found:
    """``(count, index)``: how many values of ``a`` are NaN or inf, and the index of the first (None
    when there is none).  ``a`` is a numpy or dask array; an integer one has none.  ``scheduler``: what computes
    a dask array (:func:`dask.compute`'s ``scheduler=``; None: dask's default)."""
    return scan(a, scheduler=scheduler)[0]


def scan(a: Any, limit: float | None = None, scheduler: Any = None) -> tuple[Found, Found]:
    """``(non-finite, beyond)``: the values of ``a`` that are NaN or inf, and the finite ones whose magnitude
    exceeds ``limit`` (none without one), each as :func:`first_non_finite` gives them; in one pass (of a dask
    array, computed by ``scheduler``)."""
    if not _floating(a):
        return (0, None), (0, None)
    if limit is not None and (np.dtype(a.dtype).kind != "f" or float(np.finfo(a.dtype).max) <= limit):
        limit = None  # (no value of this dtype can exceed it)
    if type(a).__module__.startswith("dask"):
        return _dask(a, limit, scheduler)
    a = np.asarray(a)
    found: list[list[Any]] = [[0, None], [0, None]]
    for start, block in _blocks(a):
        for entry, bad in zip(found, _masks(np, block, limit), strict=False):
            n = int(np.count_nonzero(bad))
            if n and entry[1] is None:
                local = np.unravel_index(int(np.argmax(bad)), bad.shape)
                entry[1] = (start + int(local[0]), *map(int, local[1:]))
            entry[0] += n
    return (found[0][0], found[0][1]), (found[1][0], found[1][1])


def _masks(xp: Any, a: Any, limit: float | None) -> list[Any]:
    """The non-finite values of ``a`` and, with a limit, the finite ones beyond it (``xp``: numpy or dask.array)."""
    finite = xp.isfinite(a)
    return [~finite] if limit is None else [~finite, finite & (abs(a) > limit)]


def _blocks(a: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    if a.ndim == 0:
        yield 0, a.reshape(1)
        return
    row_bytes = max(1, a.itemsize * math.prod(a.shape[1:]))
    step = max(1, BLOCK_BYTES // row_bytes)
    for start in range(0, a.shape[0], step):
        yield start, a[start : start + step]


def _dask(a: Any, limit: float | None, scheduler: Any) -> tuple[Found, Found]:
    import dask
    import dask.array as da

    masks = _masks(da, a, limit)
    sums = []
    for bad in masks:
        rows = bad.reshape(a.shape[0], -1).any(axis=1) if a.ndim > 1 else bad
        sums += [bad.sum(), rows.sum(), da.argmax(rows)]
    computed = dask.compute(*sums, scheduler=scheduler)  # (one pass over the chunks for both)
    found: list[Found] = []
    for i in range(len(masks)):
        count, n_rows, row = computed[3 * i : 3 * i + 3]
        if not int(n_rows):
            found.append((0, None))
            continue
        within = np.asarray(a[int(row)].compute(scheduler=scheduler))  # the first bad sample's, to name the element
        bad = _masks(np, within, limit)[i]
        rest = np.unravel_index(int(np.argmax(bad)), bad.shape) if within.ndim else ()
        found.append((int(count), (int(row), *map(int, rest))))
    return found[0], found[1] if len(found) > 1 else (0, None)


def _arrays(prepared: PreparedData) -> Iterator[tuple[str, Any]]:
    """(name, array) of what ``prepared`` trains on, in memory or lazily (dask)."""
    if prepared.form == "dataset":
        yield from _batch_arrays(prepared.sample, "the probe batch")
    elif prepared.columns is not None:  # dict data (and xarray read per variable)
        for key, value in prepared.columns.items():
            yield f"[{key!r}]", value
    elif prepared.X is not None:
        yield " X", prepared.X
        yield " y", prepared.y
    elif prepared.source is not None:  # Zarr read where it lives
        yield from _source_arrays(prepared.source)


def _source_arrays(source: Any) -> Iterator[tuple[str, Any]]:
    """Each variable a Zarr source trains on, as a dask array over its stored chunks (read once)."""
    ds = source.open()
    ds = ds.isel({source.sample_dim: slice(source.offset, source.offset + source.n)})
    names = [*source.features, *([source.label] if source.label else [])]
    for name in names:
        var = ds[name]
        chunks = var.encoding.get("chunks") or var.shape
        var = var.chunk(dict(zip(var.dims, chunks, strict=False)))
        if source.sample_dim in var.dims:  # the sample first, as the error names it
            var = var.transpose(source.sample_dim, ...)
        yield f" variable {name!r}", var.data


def _batch_arrays(batch: Any, where: str) -> Iterator[tuple[str, Any]]:
    import torch

    if isinstance(batch, torch.Tensor):
        yield f" ({where})", batch.detach().cpu().numpy() if batch.is_floating_point() else np.zeros(0)
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from _batch_arrays(value, f"{where}[{key!r}]")
    elif isinstance(batch, (tuple, list)):
        for i, value in enumerate(batch):
            yield from _batch_arrays(value, f"{where}[{i}]")


def check_finite(prepared: PreparedData, what: str = "data", dtype: Any = None, scheduler: Any = None) -> None:
    """Refuse data with NaN or inf values, naming the array, the count and the first bad index; and, given the
    model's ``dtype`` (a ``torch.dtype``), floating values beyond its range, which the cast to it makes inf.
    Dask arrays (and Zarr data, read through dask) are computed by ``scheduler`` (:func:`dask.compute`'s
    ``scheduler=``: a Client computes them on its cluster; None: dask's default).

    Raises
    ------
    DataError
        A ValueError: ``what`` holds non-finite values, or values the cast to ``dtype`` would make inf.
    """
    limit = None
    if dtype is not None:
        import torch

        limit = float(torch.finfo(dtype).max) if dtype.is_floating_point else None
    for name, array in _arrays(prepared):
        (count, first), (beyond, first_beyond) = scan(array, limit, scheduler)
        if count:
            raise DataError(
                f"{what}{name} has {count} non-finite value(s) (NaN or inf); the first at {_at(first)}. Every "
                "update of a shard holding one would be NaN: drop those samples "
                "(X[np.isfinite(X).all(axis=tuple(range(1, X.ndim)))]) or fill them (np.nan_to_num) before fit"
            )
        if beyond:
            kind = str(dtype).removeprefix("torch.")
            raise DataError(
                f"{what}{name} has {beyond} value(s) beyond the range of {kind} (magnitude above {limit:.4g}); "
                f"the first at {_at(first_beyond)}. Samples are cast to the model's dtype, {kind}, for training, "
                f"which would make them inf (and every update of their shard NaN): scale them (standardize), clip "
                f"them (np.clip(X, -{limit:.3g}, {limit:.3g})), drop those samples, or train a float64 model "
                "(model.double())"
            )


def _at(first: tuple[int, ...] | None) -> str:
    """Where the first bad value is: ``"sample 3 (index [3, 1])"``."""
    return f"sample {first[0]} (index [{', '.join(map(str, first))}])" if first else "a value (index [])"
