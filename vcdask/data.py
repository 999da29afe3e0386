"""Training data inputs -> a small, picklable description of where the data lives.

Accepted inputs (checked before any cluster work):

* ``(X, y)`` with numpy arrays, torch tensors or dask arrays;
* an ``xarray.Dataset`` (feature and label variables and the sample dimension named by
  the caller or inferred);
* a Zarr location (local path, ``s3://...``, any fsspec URL) or an Icechunk session/store
  holding such a dataset;
* a dict of equal-length arrays (each batch a dict of tensors; needs ``train_step``);
* a map-style ``torch.utils.data.Dataset`` (see :mod:`vcdask.torch_data`);
* a pandas ``DataFrame`` with ``label=`` (and ``features=``), or ``(DataFrame, Series)`` (see
  :mod:`vcdask.frames`).

A batch mirrors the data: ``(x, y)`` for ``(X, y)`` arrays and for xarray / Zarr data trained with
the default step; a dict of tensors for dict data and for xarray / Zarr data when the caller gives a
``train_step`` (one entry per variable, so several input variables stay apart).

``(X, y)`` arrays and dicts of arrays are checked and described in :mod:`vcdask._arrays`.

Zarr locations are read by the workers where they are.  In-memory and dask data is
staged once, as a Zarr group, into the run's folder of the parameter store; workers
then read only their shard's rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ._arrays import _is_dask, _prepare_dict, _prepare_xy
from ._data_options import check_options_apply
from .errors import DataError
from .prepared import PreparedData
from .store._secret_options import has_userinfo, mask_userinfo, secret_paths, secret_query
from .store._session_secrets import session_credentials
from .variables import dict_vars, infer_sample_dim, infer_vars

__all__ = ["DataError", "DataSource", "PreparedData", "Shards", "prepare_data"]

_FEATURE_NAMES = ("X", "x", "features", "image", "images", "data")


@dataclass(frozen=True)
class DataSource:
    """Where a dataset lives and how to read rows of it.  Small and picklable.

    It never holds a secret: data staged into the parameter store is opened through the
    store (``store`` and ``path``), which pickles without its credentials and reopens on a
    worker with the worker's own (see :func:`vcdask.store.share_credentials`).

    Attributes
    ----------
    url : str or None
        fsspec URL of a Zarr group (None when ``zarr_store`` is given).  For staged data, the
        group's URL in the store, for messages and cache keys (it is opened through ``store``).
    storage_options : dict
        fsspec options for ``url`` (as the user gave them for a Zarr location; empty for staged data).
    zarr_store : object or None
        A picklable Zarr store (e.g. an Icechunk session's store) holding the group.
    features : tuple of str
        Variables stacked into X (each flattened to (n, -1) when there are several).
    label : str
        The label variable.
    sample_dim : str
        The dimension along which samples (and shards) run.
    n : int
        Number of samples.
    offset : int
        First sample of this source in the group (validation split of a URL dataset).
    store : ParamStore or None
        The parameter store that holds the staged group (None for data read where it lives).
    path : str or None
        The staged group's path in the store's side files (``<run_id>/train.zarr``).
    form : {"xy", "dict"}
        ``"xy"``: rows read as ``X`` (the features, stacked) and ``y`` (the label); ``"dict"``: one
        array per variable in ``features`` (``label`` unused).
    """

    url: str | None
    features: tuple[str, ...]
    label: str
    sample_dim: str
    n: int
    storage_options: dict[str, Any] = field(default_factory=dict)
    zarr_store: Any = None
    offset: int = 0
    store: Any = None
    path: str | None = None
    form: str = "xy"

    @property
    def cache_key(self) -> tuple:
        """What identifies these rows in a worker's cache."""
        where = self.url, id(self.zarr_store) if self.zarr_store is not None else None, self.path
        return (*where, self.offset, self.form, self.features, self.label)

    def open(self):
        """Open the dataset lazily (no dask, no data read: no index is built, so a dimension's coordinate is not
        read whole at every shard's read; rows are taken by position)."""
        import xarray as xr

        if self.store is not None:
            target, kwargs = self.store.files.zarr_store(self.path, read_only=True), {}
        elif self.zarr_store is not None:
            target, kwargs = self.zarr_store, {}
        else:
            target, kwargs = self.url, {"storage_options": self.storage_options or None}
        return xr.open_zarr(target, chunks=None, consolidated=False, create_default_indexes=False, **kwargs)

    def read(self, start: int, stop: int, ds=None) -> tuple[np.ndarray, np.ndarray]:
        """Read samples ``[start, stop)`` as numpy ``(X, y)``."""
        ds = self.open() if ds is None else ds
        rows = ds.isel({self.sample_dim: slice(self.offset + start, self.offset + stop)})
        return _to_xy(rows, self.features, self.label, self.sample_dim)

    def read_columns(self, start: int, stop: int, ds=None) -> dict[str, np.ndarray]:
        """Read samples ``[start, stop)``: ``{"X": ..., "y": ...}`` for the ``"xy"`` form, else one
        array per variable (sample axis first)."""
        if self.form == "xy":
            X, y = self.read(start, stop, ds)
            return {"X": X, "y": y}
        ds = self.open() if ds is None else ds
        rows = ds.isel({self.sample_dim: slice(self.offset + start, self.offset + stop)})
        return {name: np.asarray(rows[name].transpose(self.sample_dim, ...).values) for name in self.features}

    def slice(self, start: int, stop: int) -> DataSource:
        """A source for samples ``[start, stop)`` of this one."""
        return replace(self, n=stop - start, offset=self.offset + start)


#: ``n_shards`` by default: at least this many shards per worker thread of the cluster when the run starts ...
SHARDS_PER_THREAD = 2
#: ... and more, up to :data:`MAX_SHARDS_PER_THREAD`, while a task would still train at least this many
#: steps (batches of its shard) ...
TASK_STEPS = 8
#: ... at most this many per thread.
MAX_SHARDS_PER_THREAD = 8


@dataclass(frozen=True)
class Shards:
    """Contiguous, near-equal shard boundaries over ``n`` samples."""

    n: int
    n_shards: int

    @classmethod
    def default(cls, n: int, threads: int, batch_size: int = 32) -> Shards:
        """The same number of shards for every worker thread (``threads`` on the cluster): as many as
        leave each task at least :data:`TASK_STEPS` batches of ``batch_size`` rows, from
        :data:`SHARDS_PER_THREAD` to :data:`MAX_SHARDS_PER_THREAD`; 2 for a cluster of one thread (or of none
        yet); at most one per sample.

        Each task pays a fixed cost besides its training (reading its version, waiting for the merges
        before it, uploading), so shards are as large as keep every worker busy: on the digits benchmark
        with 2 workers, 4 shards reached 0.95 accuracy in about 0.75x the time of 10 (issue 12).  With
        several tasks in flight, though, a long task trains far from the version the others move the
        server on to: the char-LM at 2 and 4 workers reached 9% and 4% lower loss at equal tokens with
        tasks of 8 steps (16 shards) than with two shards per thread (32 and 16 steps), level with DDP
        or ahead of it.  Fewer than two per thread helped digits at 4 workers and cost it at 8, so a
        dataset of few batches keeps two.  One worker thread trains its shards one after another, each
        from the other's result: there shorter tasks only add merges (``docs/benchmarks.md``, issue 38).
        """
        if threads <= 1:
            return cls(n, min(n, SHARDS_PER_THREAD))
        per_thread = -(-n // batch_size) // (TASK_STEPS * threads)
        per_thread = min(MAX_SHARDS_PER_THREAD, max(SHARDS_PER_THREAD, per_thread))
        return cls(n, min(n, per_thread * threads))

    def local_steps(self, batch_size: int, local_epochs: int = 1) -> int:
        """Optimizer steps a task takes on the smallest shard: ``local_epochs`` passes in batches of
        ``batch_size`` rows (the last one short)."""
        return local_epochs * -(-(self.n // self.n_shards) // batch_size)

    def bounds(self, shard: int) -> tuple[int, int]:
        size, extra = divmod(self.n, self.n_shards)
        start = shard * size + min(shard, extra)
        return start, start + size + (1 if shard < extra else 0)


def _to_xy(ds, features, label, sample_dim) -> tuple[np.ndarray, np.ndarray]:
    def values(name):
        var = ds[name].transpose(sample_dim, ...)
        return np.asarray(var.values)

    if len(features) == 1:
        X = values(features[0])
    else:
        X = np.concatenate([values(f).reshape(ds.sizes[sample_dim], -1) for f in features], axis=1)
    return X, values(label)


def prepare_data(
    data: Any,
    *,
    features=None,
    label=None,
    sample_dim=None,
    storage_options=None,
    what: str = "data",
    batches: str = "xy",
    collate_fn=None,
    scheduler: Any = None,
) -> PreparedData:
    """Check ``data`` and describe it; reads at most a few rows (and the labels' range for checks).

    ``features``, ``label`` and ``sample_dim`` given with training data (``what="data"``) that would ignore them
    are refused (:func:`vcdask._data_options.check_options_apply`; ``storage_options``: by ``plan``, which knows
    the validation data too).

    ``batches="dict"`` (the caller has a ``train_step``) reads xarray / Zarr data as one input per
    variable instead of stacking the features into ``X``.  ``scheduler`` computes dask data's rows and range
    (:func:`dask.compute`'s ``scheduler=``: fit's is the cluster of its ``client=``, :func:`vcdask.options.plan`;
    None: dask's default).

    Raises
    ------
    DataError
        Empty data, X/y length mismatch, unknown variables, ambiguous sample dimension.
    TypeError
        An unsupported kind of input; an option for training data that would ignore it.
    """
    import xarray as xr

    from .dtype_kinds import check_input_dtypes
    from .frames import from_pandas
    from .torch_data import is_dataset, loader_error, prepare_dataset

    if (loader := loader_error(data, what)) is not None:
        raise loader
    if what == "data":  # (validation data is read with the training's options, which arrays do not need)
        check_options_apply(data, features=features, label=label, sample_dim=sample_dim)
    if is_dataset(data):
        return prepare_dataset(data, collate_fn=collate_fn, what=what)
    frame = from_pandas(data, features, label, what)  # (a dask DataFrame: refused there, with what to pass)
    if frame is not None:  # pandas: checked, float32 features (see vcdask.frames)
        return replace(prepare_data(frame[0], what=what), feature_names=frame[1])
    if isinstance(data, Mapping) and not isinstance(data, xr.Dataset):
        return _prepare_dict(data, what, scheduler)
    if isinstance(data, (tuple, list)):
        return _prepare_xy(data, what, scheduler)
    if isinstance(data, xr.Dataset) and batches == "dict":
        names, dim = dict_vars(data, features, label, sample_dim, what)
        return _prepare_dict({n: data[n].transpose(dim, ...).data for n in names}, what, scheduler)
    if isinstance(data, xr.Dataset):
        features, label = infer_vars(data, features, label, what)
        dim = infer_sample_dim(data, features, label, sample_dim)
        n = data.sizes[dim]
        if n == 0:
            raise DataError(f"{what} is empty (0 samples along {dim!r})")
        check_input_dtypes({f"variable {f!r}": data[f].dtype for f in features}, what)  # (each, before stacking)
        X = _stack(data, features, dim)
        y = data[label].transpose(dim, ...).data
        # (the variables by name, in X's order: predict picks a DataFrame's columns or a Dataset's variables by them)
        return replace(prepare_data((X, y), what=what, scheduler=scheduler), feature_names=tuple(features))
    src = _zarr_source(data, storage_options)
    if src is not None:
        try:
            ds = src.open()
        except (FileNotFoundError, KeyError, OSError) as e:
            raise DataError(f"cannot open {what} {data!r} as a Zarr dataset: {e}") from None
        if batches == "dict":
            names, dim = dict_vars(ds, features, label, sample_dim, what)
            src = replace(src, features=names, sample_dim=dim, n=ds.sizes[dim], form="dict")
            sample = src.read_columns(0, min(4, src.n), ds)
            return PreparedData(src, n=src.n, form="dict", sample=sample)
        features, label = infer_vars(ds, features, label, what)
        dim = infer_sample_dim(ds, features, label, sample_dim)
        n = ds.sizes[dim]
        if n == 0:
            raise DataError(f"{what} {data!r} is empty (0 samples along {dim!r})")
        src = DataSource(src.url, features, label, dim, n, src.storage_options, src.zarr_store)
        check_input_dtypes({f"variable {f!r}": ds[f].dtype for f in features}, what)
        sx, sy = src.read(0, min(4, n), ds)
        labels = ds[label]
        lo = hi = None
        if np.issubdtype(labels.dtype, np.integer):
            vals = np.asarray(labels.values)
            lo, hi = int(vals.min()), int(vals.max())
        return PreparedData(src, None, None, n, sx.shape[1:], sx.dtype, sy.dtype, sx, sy, lo, hi)
    raise TypeError(
        f"unsupported {what} type {type(data).__name__}; expected (X, y) arrays (numpy, torch or dask), a pandas "
        "DataFrame (with label=) or (DataFrame, Series), an xarray.Dataset, a Zarr path or URL, an Icechunk session "
        "or its store, a dict of equal-length arrays (with train_step=), or a map-style torch.utils.data.Dataset"
    )


def _stack(ds, features, dim):
    if len(features) == 1:
        return ds[features[0]].transpose(dim, ...).data
    import dask.array as da

    parts = [ds[f].transpose(dim, ...).data for f in features]
    lazy = any(_is_dask(p) for p in parts)
    mod = da if lazy else np
    return mod.concatenate([p.reshape(ds.sizes[dim], -1) for p in parts], axis=1)


def _zarr_source(data: Any, storage_options) -> DataSource | None:
    """The source of a Zarr location or an Icechunk session / store (None for other data).  Refused
    (:class:`DataError`, naming where and never what): a URL with credentials in it (before its host, or a signed
    URL's query), secret ``storage_options``
    (at any depth), and an Icechunk session whose pickle would carry its repository's credentials."""
    import os

    if isinstance(data, os.PathLike):
        data = os.fspath(data)
    if isinstance(data, str):
        if has_userinfo(data):
            raise DataError(
                f"the data location {mask_userinfo(data)!r} holds credentials (user:secret@host): {_NO_SECRETS}, "
                f"and the location is in both. {_OWN_CREDENTIALS}, and give the URL without them"
            )
        if query := secret_query(data):  # (a SAS or a presigned URL: the signature is the credential)
            raise DataError(
                f"the data location holds credentials in its query ({query}, named here by their names only): "
                f"{_NO_SECRETS}, and the location is in both. {_OWN_CREDENTIALS}, and give the URL without them"
            )
        secret = secret_paths(storage_options or {})
        if secret:
            raise DataError(
                f"storage_options for {data!r} hold credentials ({secret}), named here by their keys only: "
                f"{_NO_SECRETS}. {_OWN_CREDENTIALS} (profile=... is fine here), and pass only non-secret options "
                "such as endpoint_url"
            )
        return DataSource(_absolute(data), (), "", "", 0, dict(storage_options or {}))
    mod = type(data).__module__
    if mod.startswith("icechunk"):
        held = session_credentials(data)
        if held:
            raise DataError(
                f"the Icechunk session given as data holds {' and '.join(held)}: Icechunk pickles them with it, and "
                f"{_NO_SECRETS}. Open its repository with credentials that each worker (and the scheduler) finds "
                "itself, e.g. icechunk.s3_storage(..., from_env=True) with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                "a profile or an instance role on the cluster (gcs_storage / azure_storage(..., from_env=True) "
                "alike); or pass the data's location (a URL, with storage_options such as endpoint_url); or have it "
                "copied into the run's store: xr.open_zarr(session.store, consolidated=False, chunks=None), read "
                "here and staged"
            )
        store = data.store if hasattr(data, "snapshot_id") else data  # a Session or its store
        return DataSource(None, (), "", "", 0, {}, store)
    return None


_NO_SECRETS = "vcdask never writes secrets into a run's spec or its tasks' arguments"
_OWN_CREDENTIALS = (
    "Give the workers (and the scheduler) credentials of their own: environment variables (AWS_ACCESS_KEY_ID / "
    "AWS_SECRET_ACCESS_KEY ...), a profile or an instance role"
)


def _absolute(url: str) -> str:
    """``url`` as the workers open it: a local path (no scheme, ``file://`` or ``local://``) made absolute against
    this process's working directory when ``fit`` is called, as the checks read it (a worker's is another: the one
    it started in, before an ``os.chdir`` or Jupyter's ``%cd`` here, or on another machine); other URLs as given."""
    import os

    from fsspec.core import split_protocol

    protocol, path = split_protocol(url)
    if protocol is None:
        return os.path.abspath(os.path.expanduser(url))
    if protocol in ("file", "local"):
        return f"{protocol}://{os.path.abspath(os.path.expanduser(path))}"
    return url  # (another filesystem, or a chain of them: "simplecache::s3://...")
