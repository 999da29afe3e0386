"""What :func:`vcdask.data.prepare_data` found: :class:`PreparedData`, the checked description of a run's data.

Its own module, below :mod:`vcdask.data` and the modules that prepare or read it
(:mod:`vcdask.torch_data`, :mod:`vcdask.steps`) or check it (:mod:`vcdask.preflight`,
:mod:`vcdask.finite`), which use it: none of them imports :mod:`vcdask.data` for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PreparedData"]


@dataclass
class PreparedData:
    """Data checked on the client: what to stage (if anything) and how workers will read it."""

    source: Any  # a vcdask.data.DataSource for data read where it lives, else None
    X: Any = None  # in-memory / dask arrays to stage
    y: Any = None
    n: int = 0
    x_shape: tuple[int, ...] = ()
    x_dtype: Any = None
    y_dtype: Any = None
    sample_X: np.ndarray | None = None  # a few rows, for checks against the model
    sample_y: np.ndarray | None = None
    y_min: float | None = None
    y_max: float | None = None
    form: str = "xy"  # "xy", "dict" or "dataset": the shape of a batch
    columns: dict[str, Any] | None = None  # dict data to stage (form "dict")
    sample: Any = None  # dict data: a few rows of each column; a Dataset: a collated probe batch
    feature_names: tuple = ()  # pandas, xarray data: feature columns or variables, in X's order (predict picks them)
    #: The rows of ``X`` and ``y`` (or of ``columns``) that are staged, in that order: the seeded shuffle's and the
    #: validation split's share (gathered a chunk at a time as they are written: no copy of the data); None: as they
    #: are
    order: np.ndarray | None = None

    @property
    def classification(self) -> bool:
        """Whether the labels are class ids: integer or bool (two classes, False 0 and True 1, as a DataFrame's
        bool label column is); float labels are a regression."""
        return self.y_dtype is not None and (self.bool_labels or np.issubdtype(np.dtype(self.y_dtype), np.integer))

    @property
    def bool_labels(self) -> bool:
        """Whether the labels are bool: two classes."""
        return self.y_dtype is not None and np.dtype(self.y_dtype) == np.bool_

    @property
    def label_range(self) -> tuple[int, int] | None:
        """The smallest and largest class id of classification data (bool labels: 0 and 1, their two classes,
        whichever the data holds); None for a regression."""
        if self.bool_labels:
            return 0, 1
        if not self.classification or self.y_min is None or self.y_max is None:
            return None
        return int(self.y_min), int(self.y_max)

    def arrays(self) -> dict[str, Any]:
        """The columns to stage (``X`` and ``y``, or a dict's), their rows in the order they are staged (copies,
        with an ``order``: for a look at small data; :func:`~vcdask.staging.stage` gathers them a chunk at a
        time)."""
        columns = dict(self.columns or {}) if self.form == "dict" else {"X": self.X, "y": self.y}
        if self.order is None:
            return columns
        return {k: np.take(a, self.order, axis=0) for k, a in columns.items()}

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each input's per-sample shape (what validation data must match)."""
        if self.form == "dict":
            return {k: tuple(v.shape[1:]) for k, v in self.sample.items()}
        return {"X": tuple(self.x_shape)}
