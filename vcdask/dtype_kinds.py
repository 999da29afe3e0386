"""What a model cannot take as numbers, refused by name with the remedy: inputs of dtype kinds ``U S O M m c V``
(strings, Python objects, datetimes, durations, complex numbers, structured records) and labels that are strings.

Called by :mod:`vcdask.data` (each variable of xarray / Zarr data, before stacking), :mod:`vcdask.frames` (a
string label column) and :mod:`vcdask.preflight` (the probe rows of the training data), before any cluster work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import DataError

__all__ = ["check_input_dtypes", "string_labels_error"]

#: What an input of each dtype kind a model cannot take holds, and (by kinds) how to make numbers of it.
_NOT_NUMBERS = {"U": "strings", "S": "strings", "O": "Python objects", "M": "datetimes", "m": "durations"}
_NOT_NUMBERS.update(c="complex numbers", V="structured records (or raw bytes)")
_REMEDIES = {
    "USO": "convert numeric text with X.astype('float32'), encode categories as numbers (pandas.factorize, "
    "sklearn.preprocessing.OrdinalEncoder), or pass a DataFrame with label= (it checks each column)",
    "Mm": "convert datetimes and durations to numbers, such as seconds ((t - t.min()) / np.timedelta64(1, 's')) or "
    "calendar features (day of week, hour)",
    "c": "the cast to the model's dtype would drop the imaginary part: give the real and imaginary parts as "
    "features (np.stack([X.real, X.imag], axis=-1))",
    "V": "give the fields as one numeric array (numpy.lib.recfunctions.structured_to_unstructured(X))",
}


def check_input_dtypes(inputs: Mapping[str, Any], what: str = "data") -> None:
    """Refuse inputs of dtypes a model cannot take as numbers (kinds ``U S O M m c V``), each named with its dtype.

    Parameters
    ----------
    inputs : mapping of str to array or dtype
        Name (``"X"``, ``"variable 't'"``) -> an array (a few rows: a string one's first values are shown) or a dtype.
    what : str
        ``"data"`` or ``"validation"``, for the message.

    Raises
    ------
    TypeError
        Naming every such input, what it holds and how to make numbers of it.
    """
    found, kinds = [], set()
    for name, a in inputs.items():
        dtype = np.dtype(getattr(a, "dtype", a))
        if dtype.kind in _NOT_NUMBERS:
            kinds.add(dtype.kind)
            shown = a.ravel()[:2].tolist() if isinstance(a, np.ndarray) and dtype.kind in "USO" else []
            example = f", e.g. {', '.join(map(repr, shown))}" if shown else ""
            found.append(f"{what} {name} holds {_NOT_NUMBERS[dtype.kind]} ({dtype}{example})")
    if not found:
        return
    remedies = [fix for group, fix in _REMEDIES.items() if kinds & set(group)]
    raise TypeError(f"{'; '.join(found)}; a model takes numbers: {'; '.join(remedies)}")


def string_labels_error(y: np.ndarray, name: str = "the labels", remedy: str = "") -> DataError:
    """The error for labels that are strings (or other objects): classification needs integer class ids (``remedy``:
    more of what to do, appended)."""
    values = [v for v in np.asarray(y).ravel()[:3].tolist()]
    kind = "strings" if y.dtype.kind in "US" or any(isinstance(v, str) for v in values) else f"{y.dtype} objects"
    return DataError(
        f"{name} are {kind} (e.g. {', '.join(repr(v) for v in values)}); classification needs integer class ids "
        "0..k-1: encode them with codes, classes = pandas.factorize(y) (or "
        "sklearn.preprocessing.LabelEncoder().fit_transform(y)), train on the codes and keep the classes to name "
        f"the predictions (classes[result.predict(X)]){remedy}"
    )
