"""pandas inputs -> arrays: a DataFrame with ``label=`` (and ``features=``), or ``(DataFrame, Series)``.

Feature columns must be numeric or bool; they become one float32 array ``X`` (n, n_features), in the
order of ``features`` (default: every column but the label).  Integer and bool labels become int64 class
ids (classification), float labels float32 (regression), as for ``(X, y)`` arrays; a one-column DataFrame
as ``y`` gives its column's labels (n,), as the Series would.  ``(df, df["target"])``, the labels' column
still among the features with the labels' values, is refused (the model would train on its own labels).
Categorical, string, object and datetime feature columns are refused with the columns named and the remedy;
so are missing values, and dask DataFrames (with what to pass instead: their columns as dask arrays).  The
arrays are fresh and writable (a pandas column can hand out a read-only view, which torch warns about).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from .dtype_kinds import string_labels_error
from .errors import DataError
from .variables import _LABEL_NAMES

__all__ = ["frame_features", "from_pandas", "is_frame", "is_series"]


def is_frame(obj: Any) -> bool:
    """Whether ``obj`` is a pandas DataFrame (without importing pandas)."""
    return type(obj).__module__.startswith("pandas") and type(obj).__name__ == "DataFrame"


def is_series(obj: Any) -> bool:
    """Whether ``obj`` is a pandas Series (without importing pandas)."""
    return type(obj).__module__.startswith("pandas") and type(obj).__name__ == "Series"


def _is_dask_frame(a: Any) -> bool:
    """Whether ``a`` is a dask DataFrame, Series or Index (without importing dask.dataframe)."""
    return type(a).__module__.startswith(("dask.dataframe", "dask_expr"))


def _dask_frame_error(a: Any, what: str, label: Any = None) -> TypeError:
    """What to pass instead of a dask DataFrame: its columns as dask arrays of known chunk sizes."""
    y = "ddf[label]" if label is None else f"ddf[{label!r}]"
    return TypeError(
        f"{what}: a dask DataFrame or Series ({type(a).__module__}.{type(a).__qualname__}) is not taken as it "
        f"is; pass its columns as dask arrays of known chunk sizes, (ddf[features].to_dask_array(lengths=True), "
        f"{y}.to_dask_array(lengths=True)) with features the numeric feature columns' names (lengths=True counts "
        "the rows of each partition), or, when it fits in memory, the pandas DataFrame ddf.compute() (with label=)"
    )


def from_pandas(data: Any, features: Any, label: Any, what: str) -> tuple[tuple[Any, Any], tuple] | None:
    """``((X, y), feature names)`` for pandas data; None for anything else.

    Parameters
    ----------
    data : DataFrame, (DataFrame, Series) or anything
        A whole DataFrame (with ``label``), or ``(X, y)`` where either is a pandas object.
    features : str or sequence of column names, optional
        The feature columns (default: every column but the label).
    label : column name, optional
        The label column of a whole DataFrame (default: a column named ``y``, ``label``, ``labels``,
        ``target`` or ``targets``).
    what : str
        ``"data"`` or ``"validation"``, for messages.

    Raises
    ------
    DataError
        An unknown column, non-numeric feature columns, missing values, string labels.
    TypeError
        A dask DataFrame or Series (as ``data`` or in ``(X, y)``), naming what to pass instead.
    """
    if _is_dask_frame(data):
        raise _dask_frame_error(data, what, label)
    if isinstance(data, (tuple, list)) and len(data) == 2:
        for a in data:
            if _is_dask_frame(a):
                raise _dask_frame_error(a, what)
    if is_frame(data):
        columns = list(data.columns)
        if label is None:
            found = [c for c in _LABEL_NAMES if c in columns]
            if not found:
                raise DataError(
                    f"{what}: cannot tell which column holds the labels among {columns}; pass label=<column> "
                    f"(columns named {list(_LABEL_NAMES)} are found automatically)"
                )
            label = found[0]
        if label not in columns:
            raise DataError(f"{what}: label column {label!r} is not in the DataFrame; columns: {columns}")
        _check_unique(data, [label], what)
        chosen = [c for c in columns if c != label] if features is None else _names(features)
        if label in chosen:
            raise DataError(f"{what}: the label column {label!r} is also among features={chosen}; leave it out")
        X, names = frame_features(data, chosen, what)
        return (X, _labels(data[label], f"{what}: the labels in column {label!r}")), names
    if isinstance(data, (tuple, list)) and len(data) == 2 and any(is_frame(a) or is_series(a) for a in data):
        X, y = data
        if is_frame(y) and y.shape[1] != 1:
            raise DataError(f"{what}: y as a DataFrame must have one column, got {list(y.columns)}")
        names = ()
        if is_frame(X):
            chosen = list(X.columns) if features is None else _names(features)
            _check_label_not_a_feature(X, chosen, y, features, what)
            X, names = frame_features(X, chosen, what)
        elif is_series(X):
            named = X.name is not None  # an unnamed Series names no column
            _check_label_not_a_feature(X.to_frame(), [X.name] if named else [], y, features, what)
            X, names = frame_features(X.to_frame(), [X.name if named else 0], what)
            names = names if named else ()
        if is_frame(y):  # one column: its labels (n,), class ids and floats alike, as a Series gives them
            y = y.iloc[:, 0]
        if is_series(y):
            y = _labels(y, f"{what}: the labels (y)")
        return (X, y), tuple(names)
    return None


def _check_label_not_a_feature(X: Any, chosen: list, y: Any, features: Any, what: str) -> None:
    """Refuse ``(df, df["target"])``: the labels' column among the feature columns ``chosen`` of ``X`` would
    train the model on its own labels (and ``predict`` would need them).

    The labels' column is a Series' name or a one-column DataFrame's column; an unnamed Series names none, nor
    does ``pd.DataFrame(y)``'s default column ``0``.  A column of ``X`` of that name is the labels' only when its
    values are the labels' too: yesterday's ``sales`` as a feature beside today's as the labels,
    ``(df.shift(1).iloc[1:], df["sales"].iloc[1:])``, is taken, as is column ``0`` of ``pd.DataFrame(X)`` beside
    ``pd.Series(y, name=0)`` when it holds other values.

    Raises
    ------
    DataError
        The labels' column is a feature column, naming it and the remedies.
    """
    import pandas as pd

    if is_frame(y):
        name = None if isinstance(y.columns, pd.RangeIndex) else y.columns[0]
        y = y.iloc[:, 0]
    else:
        name = y.name if is_series(y) else None
    if name is None or name not in X.columns or not any(c == name for c in chosen):
        return  # (a feature column that X lacks is refused by frame_features)
    if not _same_values(X[name], y):
        return  # (a lagged copy, df.shift(1)'s 'sales' beside 'sales'; or column 0 of pd.DataFrame(X): no leak)
    choose = " or choose the feature columns with features=[...]," if features is None else ""
    raise DataError(
        f"{what}: the labels (y, column {name!r}) are also a feature column of X: the model would train with its "
        f"own labels as an input (a validation score that means nothing, and predict would need the labels). "
        f"Leave the column out of X, (df.drop(columns={name!r}), df[{name!r}]),{choose} or pass the whole "
        f"DataFrame with label={name!r}"
    )


def _same_values(column: Any, y: Any) -> bool:
    """Whether the feature ``column`` holds the labels ``y`` (both pandas Series), row by row, as the model would
    get them: compared as float32 (the features' dtype; an int64 label column beside its float copy is the same),
    NaN equal to NaN, the index ignored (rows are taken by position).  Columns that are not numbers are compared
    as they are."""
    import pandas as pd

    if column.shape != y.shape:
        return False  # (lengths that differ are refused later, naming both)
    try:
        a = column.to_numpy(dtype="float32", na_value=np.nan)
        b = y.to_numpy(dtype="float32", na_value=np.nan)
    except (TypeError, ValueError):
        return bool(pd.Series(column.to_numpy()).equals(pd.Series(y.to_numpy())))
    return bool(np.array_equal(a, b, equal_nan=True))


def frame_features(df: Any, names: Sequence, what: str) -> tuple[np.ndarray, tuple]:
    """The columns ``names`` of ``df`` as one writable float32 array (n, len(names)), checked.

    Raises
    ------
    DataError
        Columns not in ``df``; categorical, string, object or datetime columns (named, with the remedy);
        missing values.
    """
    import pandas as pd

    columns = list(df.columns)
    missing = [c for c in names if c not in columns]
    if missing:
        raise DataError(f"{what}: feature column(s) {missing} not in the DataFrame; columns: {columns}")
    if not names:
        raise DataError(f"{what}: no feature columns; the DataFrame's columns: {columns}")
    _check_unique(df, names, what)
    part = df[list(names)]
    categorical = [c for c in names if isinstance(part[c].dtype, pd.CategoricalDtype)]
    text = [
        c
        for c in names
        if c not in categorical
        and (pd.api.types.is_string_dtype(part[c].dtype) or pd.api.types.is_object_dtype(part[c].dtype))
    ]
    complex_ = [c for c in names if pd.api.types.is_complex_dtype(part[c].dtype)]  # (numeric to pandas)
    other = [
        c
        for c in names
        if c not in categorical
        and c not in text
        and c not in complex_
        and not (pd.api.types.is_numeric_dtype(part[c].dtype) or pd.api.types.is_bool_dtype(part[c].dtype))
    ]
    if categorical or text or other or complex_:
        kinds = (("categorical", categorical), ("string/object", text), ("complex", complex_), ("other", other))
        found = "; ".join(f"{kind} {cols}" for kind, cols in kinds if cols)
        bad = [*categorical, *text, *complex_, *other]
        encode = [*categorical, *text, *other]
        fixes = []
        if encode:
            fixes.append(
                f"Encode {encode} first: one-hot with pandas.get_dummies(df, columns={encode}, dtype=float), or "
                "integer codes with df[col].astype('category').cat.codes"
            )
        if complex_:
            fixes.append(
                f"{'g' if fixes else 'G'}ive the real and imaginary parts of {complex_} as two columns each "
                "(df[col].to_numpy().real, .imag): the cast to float32 would drop the imaginary part"
            )
        raise DataError(
            f"{what}: feature columns must be numeric or bool (they become float32), got {found} "
            f"({', '.join(f'{c}: {part[c].dtype}' for c in bad)}). {'; '.join(fixes)}; or leave "
            "them out with features=[...]"
        )
    nulls = {c: int(n) for c, n in part.isna().sum().items() if n}
    if nulls:
        raise DataError(
            f"{what}: feature columns have missing values {nulls} (column: count); drop the rows with "
            f"df.dropna(subset={list(nulls)}) or fill them with df.fillna(...)"
        )
    beyond = {c: n for c in names if (n := _beyond_float32(part[c]))}
    if beyond:
        raise DataError(
            f"{what}: feature columns hold values beyond float32's range (magnitude above {_F32_MAX:.4g}) "
            f"{beyond} (column: count); the features are cast to float32, which would make them inf: scale "
            f"those columns (standardize), clip them (df[col].clip(-{_F32_MAX:.3g}, {_F32_MAX:.3g})) or drop "
            "those rows"
        )
    X = part.to_numpy(dtype=np.float32)
    return _writable(X), tuple(names)


_F32_MAX = float(np.finfo(np.float32).max)


def _beyond_float32(s: Any) -> int:
    """How many values of a column (a float one wider than float32) the cast to float32 would make inf."""
    import pandas as pd

    if not pd.api.types.is_float_dtype(s.dtype) or np.dtype(getattr(s.dtype, "numpy_dtype", s.dtype)).itemsize <= 4:
        return 0
    return int(np.count_nonzero(np.abs(s.to_numpy(dtype=np.float64)) > _F32_MAX))


def _check_unique(df: Any, names: Sequence, what: str) -> None:
    """Columns are picked by name: one that names several columns (``pd.concat(..., axis=1)``) is refused."""
    counts = Counter(df.columns)
    duplicates = {c: counts[c] for c in dict.fromkeys(names) if counts[c] > 1}
    if duplicates:
        raise DataError(
            f"{what}: the DataFrame has duplicate column names {duplicates} (name: columns); vcdask picks columns "
            "by name: rename them (df.columns = [...]) or drop the copies (df.loc[:, ~df.columns.duplicated()])"
        )


def _labels(s: Any, name: str) -> np.ndarray:
    """A label Series as a writable array: int64 class ids (integer, bool), float32 (float)."""
    import pandas as pd

    dtype = s.dtype
    if isinstance(dtype, pd.CategoricalDtype):
        raise DataError(
            f"{name} are categorical ({list(dtype.categories[:3])}...); classification needs integer class ids: "
            "train on s.cat.codes and keep s.cat.categories to name the predictions"
        )
    if pd.api.types.is_string_dtype(dtype) or pd.api.types.is_object_dtype(dtype):
        raise string_labels_error(s.to_numpy(dtype=object), name)
    if int(s.isna().sum()):
        raise DataError(f"{name} has {int(s.isna().sum())} missing values; drop those rows (df.dropna(subset=[...]))")
    if pd.api.types.is_bool_dtype(dtype) or pd.api.types.is_integer_dtype(dtype):
        return _writable(s.to_numpy(dtype=np.int64))
    if pd.api.types.is_float_dtype(dtype):
        if beyond := _beyond_float32(s):
            raise DataError(
                f"{name} has {beyond} value(s) beyond float32's range (magnitude above {_F32_MAX:.4g}); float labels "
                "are cast to float32, which would make them inf: scale them (or clip them) first"
            )
        return _writable(s.to_numpy(dtype=np.float32))
    raise DataError(f"{name} has dtype {dtype}; labels must be integer class ids, bool or floats")


def _names(features: Any) -> list:
    return [features] if isinstance(features, str) else list(features)


def _writable(a: np.ndarray) -> np.ndarray:
    """``a`` as a writable, C-contiguous array (a copy only when it is not one already)."""
    return np.require(a, requirements=["W", "C"])
