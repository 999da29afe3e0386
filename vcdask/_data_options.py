"""Refuse the data options that the training data would ignore.

``features=``, ``label=``, ``sample_dim=`` and ``storage_options=`` each apply to some kinds of data only; given
with another kind, :func:`vcdask.fit` used to drop them without a word, and who thought they chose two columns,
the samples' dimension or how the data is opened trained on something else.  :func:`check_options_apply` names
the option, the kind of data and what to do instead, before any cluster work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["check_options_apply", "check_storage_options", "data_kind"]

#: Each kind of data as a message names it.
_KINDS = {
    "pandas": "(X, y) with y the labels",
    "frame": "a whole pandas DataFrame",
    "dataset": "a torch Dataset",
    "dict": "a dict of arrays",
    "arrays": "(X, y) arrays",
    "xarray": "an xarray.Dataset, open already",
    "icechunk": "an Icechunk session or store, which has its own storage",
    "path": "a local path, which Zarr opens without fsspec (file:///... is a URL it opens with them)",
}

#: How to choose the inputs and the labels of data that names no columns or variables.
_NAMES_FIX = {
    "pandas": "Leave label= out: y holds the labels already (features= picks X's columns when X is a DataFrame); "
    "or pass the whole DataFrame with label= (and features=)",
    "dataset": "Its items are what the model and the loss get: choose the inputs and the labels in its __getitem__ "
    "(or in a Dataset that wraps it)",
    "dict": "Each batch holds every array of the dict, by key: pass only those to train on ({k: data[k] for k in "
    "[...]}), and let train_step pick the inputs and the labels by key",
    "arrays": "Choose the feature columns yourself, X[:, [0, 2, 5]], and give the labels as y; or pass a pandas "
    "DataFrame with label= and features=",
}

#: The kinds ``sample_dim=`` applies to (``storage_options=``: ``"location"`` alone, a Zarr URL).
_HAS_DIMS = ("xarray", "location", "path", "icechunk")


def data_kind(data: Any) -> str | None:
    """The kind of training data as far as its options go: ``"location"`` (a Zarr URL), ``"path"`` (a local path
    with no scheme), ``"icechunk"``, ``"xarray"``, ``"frame"``, ``"pandas"`` (a pair with a pandas part),
    ``"dataset"``, ``"dict"``, ``"arrays"`` (another pair), or None for data of no supported kind
    (:func:`vcdask.data.prepare_data` refuses it)."""
    import os

    import xarray as xr

    from .frames import is_frame
    from .torch_data import is_dataset

    if isinstance(data, (str, os.PathLike)):
        from fsspec.core import split_protocol

        return "path" if split_protocol(os.fspath(data))[0] is None else "location"
    if type(data).__module__.startswith("icechunk"):
        return "icechunk"
    if isinstance(data, xr.Dataset):
        return "xarray"
    if is_frame(data):
        return "frame"
    pair = isinstance(data, (tuple, list)) and len(data) == 2
    if pair and any(type(a).__module__.startswith("pandas") for a in data):
        return "pandas"
    if is_dataset(data):
        return "dataset"
    if isinstance(data, Mapping):
        return "dict"
    return "arrays" if pair else None


def check_options_apply(data: Any, *, features: Any = None, label: Any = None, sample_dim: Any = None) -> None:
    """Refuse an option that ``data`` would ignore, with a :class:`TypeError` naming it and the remedy.

    A whole DataFrame, an xarray Dataset, a Zarr location and an Icechunk session use ``features`` and ``label``;
    ``(DataFrame, y)`` uses ``features`` (``X``'s columns), not ``label``; arrays, dicts and torch Datasets neither.
    ``sample_dim`` applies to xarray, Zarr and Icechunk data (others have their samples first).  Data of no supported
    kind is left to :func:`vcdask.data.prepare_data`'s own refusal.
    """
    from .frames import is_frame

    kind = data_kind(data)
    if kind is None:
        return
    given = {name: v for name, v in (("features", features), ("label", label)) if v is not None}
    if kind == "pandas" and is_frame(data[0]):  # (features= picks X's columns)
        given.pop("features", None)
    if kind in _NAMES_FIX and given:
        it = "them" if len(given) > 1 else "it"
        raise TypeError(
            f"{' and '.join(f'{k}={v!r}' for k, v in given.items())}: {' and '.join(given)} "
            f"name{'s' if it == 'it' else ''} columns or variables, of a whole pandas DataFrame, an xarray.Dataset, "
            f"a Zarr path or URL or an Icechunk session; the data is {_KINDS[kind]}, which would ignore {it}. "
            f"{_NAMES_FIX[kind]}"
        )
    if sample_dim is not None and kind not in _HAS_DIMS:
        raise TypeError(
            f"sample_dim={sample_dim!r}: sample_dim names the dimension along which the samples lie, of an "
            f"xarray.Dataset, a Zarr path or URL or an Icechunk session; the data is {_KINDS[kind]}, whose samples "
            "are its first axis (its rows, or its items), so it would ignore it. Leave sample_dim out, and put the "
            "samples first (np.moveaxis(X, axis, 0)) if they are not"
        )


def check_storage_options(data: Any, storage_options: Any, validation: Any = None) -> None:
    """Refuse ``storage_options`` that neither the training data nor the validation data (read with the training's
    options) would use: only a Zarr URL does (an empty mapping is no option; Zarr itself refuses them for a path
    with no scheme).  The refusal names their keys, never their values (which may hold credentials)."""
    kind = data_kind(data)
    if not storage_options or kind in (None, "location") or data_kind(validation) == "location":
        return
    named = (
        f"keys {sorted(map(str, storage_options))}"
        if isinstance(storage_options, Mapping)
        else f"a {type(storage_options).__name__}"
    )
    raise TypeError(
        f"storage_options ({named}): storage_options are fsspec options for opening a Zarr URL given as data or "
        f"validation (s3://..., file://...); the data is {_KINDS[kind]}, which would ignore them. Leave "
        "storage_options out, or pass the Zarr URL with them"
    )
