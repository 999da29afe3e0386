"""Which variables of an xarray / Zarr dataset are the features, the label and the sample dimension
(named by the caller, or inferred when unambiguous; each error names the candidates).

Inferred feature variables are sorted by name: a Zarr group opened without consolidated metadata lists its
variables in an order that can change from one opening to the next, and ``X`` stacks the features in
this order.  Features named by the caller keep the caller's order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import DataError

if TYPE_CHECKING:
    from .prepared import PreparedData

__all__ = ["dict_vars", "infer_sample_dim", "infer_vars", "recorded_features", "stored_order", "training_features"]

_LABEL_NAMES = ("y", "label", "labels", "target", "targets")


def infer_vars(ds, features, label, what: str = "data") -> tuple[tuple[str, ...], str]:
    """The feature variables (the caller's, in the caller's order, or every other variable sorted by name)
    and the label variable."""
    names = list(ds.data_vars)
    if label is None:
        found = [n for n in _LABEL_NAMES if n in ds.data_vars]
        if not found:
            raise DataError(
                f"cannot tell which variable holds the labels among {names}; pass label=<name> "
                f"(variables named {list(_LABEL_NAMES)} are found automatically)"
            )
        label = found[0]
    if label not in ds.data_vars:
        raise DataError(f"label variable {label!r} not in the dataset; variables: {names}")
    if features is None:
        features = sorted((n for n in names if n != label), key=str)
        if not features:
            raise DataError(f"the dataset has no feature variables besides the label {label!r}")
    elif isinstance(features, str):
        features = [features]
    missing = [f for f in features if f not in ds.data_vars]
    if missing:
        raise DataError(
            f"{what}: feature variable(s) {missing} not in the dataset (features: {list(features)}); "
            f"its variables: {names}"
        )
    return tuple(features), label


def infer_sample_dim(ds, features, label, sample_dim) -> str:
    if sample_dim is not None:
        for name in (*features, label):
            if sample_dim not in ds[name].dims:
                raise DataError(
                    f"sample dimension {sample_dim!r} is not a dimension of {name!r} "
                    f"(its dimensions: {list(ds[name].dims)})"
                )
        return sample_dim
    common = [d for d in ds[label].dims if all(d in ds[f].dims for f in features)]
    if len(common) != 1:
        raise DataError(
            f"cannot infer the sample dimension: candidates {common} (dimensions shared by "
            f"{[*features, label]}); pass sample_dim=<name>"
        )
    return common[0]


def dict_vars(ds, features, label, sample_dim, what) -> tuple[tuple[str, ...], str]:
    """The variables of a dataset read as a dict batch, and the sample dimension."""
    if features is None:
        names = list(ds.data_vars)
    else:
        names = [features] if isinstance(features, str) else list(features)
        if label is not None and label not in names:
            names.append(label)
    missing = [n for n in names if n not in ds.data_vars]
    if missing or not names:
        raise DataError(f"{what}: variable(s) {missing} not in the dataset; variables: {list(ds.data_vars)}")
    if sample_dim is None:
        common = [d for d in ds[names[0]].dims if all(d in ds[n].dims for n in names)]
        if len(common) != 1:
            raise DataError(
                f"cannot infer the sample dimension of {names}: candidates {common}; pass sample_dim=<name>"
            )
        sample_dim = common[0]
    bad = [n for n in names if sample_dim not in ds[n].dims]
    if bad:
        raise DataError(f"sample dimension {sample_dim!r} is not a dimension of {bad}")
    if ds.sizes[sample_dim] == 0:
        raise DataError(f"{what} is empty (0 samples along {sample_dim!r})")
    return tuple(names), sample_dim


def training_features(data: Any, prepared: PreparedData, features=None, label=None) -> tuple:
    """The named features of training ``data``, in the order ``X`` stacks them: validation data reads these.

    A DataFrame's feature columns, or an xarray / Zarr dataset's feature variables (``prepared`` is
    what :func:`prepare_data` made of ``data`` with ``features`` and ``label``); ``()`` for arrays, which
    name none, and for dict and torch Dataset batches, which are not stacked.
    """
    import xarray as xr

    if prepared.form != "xy":
        return ()
    if prepared.feature_names:
        return tuple(prepared.feature_names)
    if prepared.source is not None:
        return tuple(prepared.source.features)
    if isinstance(data, xr.Dataset):  # staged from memory: the same inference prepare_data made
        return infer_vars(data, features, label)[0]
    return ()


def recorded_features(train: PreparedData) -> tuple:
    """The names of ``X``'s columns, in its order, as a run records them: a DataFrame's feature columns, or
    the feature variables of an xarray / Zarr dataset when each is one column of ``X`` (a variable of several
    values per sample names no one column); ``()`` when they name none.  ``FitResult.predict`` selects a
    DataFrame's columns, or a Dataset's variables, by them."""
    names = tuple(train.feature_names)
    if not names and train.source is not None and train.form == "xy":
        names = tuple(train.source.features)
    return names if tuple(train.x_shape) == (len(names),) else ()


def stored_order(data: Any) -> bool:
    """Whether ``data`` is trained on in its stored order however ``shuffle`` is set: an xarray Dataset,
    in memory or dask-backed alike (:func:`~vcdask.staging.split` shuffles numpy arrays only, so dask and
    Zarr data keep their order too)."""
    import xarray as xr

    return isinstance(data, xr.Dataset)
