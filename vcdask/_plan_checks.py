"""Checks of :func:`vcdask.options.plan` that need no model: the custom steps against the default step's options
(:func:`check_step_options`), and validation data of the training's kind (:func:`check_same_form`, its labels:
:func:`check_label_kind`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .data import DataError, PreparedData
from .groups import Merging, Stopping, Training
from .resilience import Resilience

__all__ = ["check_groups", "check_label_kind", "check_same_form", "check_step_options"]


def check_groups(**groups: Any) -> None:
    """Each option group given to :func:`vcdask.options.plan` (``merging=``, ``training=``, ``stopping=``,
    ``resilience=``, by keyword) is an instance of its class (:class:`vcdask.Merging`, ...).

    Raises
    ------
    TypeError
        Naming the keyword, its class and the type given.
    """
    classes = {"merging": Merging, "training": Training, "stopping": Stopping, "resilience": Resilience}
    for name, group in groups.items():
        cls = classes[name]
        if not isinstance(group, cls):
            raise TypeError(f"{name} must be a vcdask.{cls.__name__}, got {type(group).__name__}")


def check_step_options(train_step: Any, eval_step: Any, loss: Any, metrics: Any) -> None:
    """The custom steps, and the default step's options that they replace."""
    for name, fn in (("train_step", train_step), ("eval_step", eval_step)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a callable (model, batch) -> ..., got {type(fn).__name__}")
    if eval_step is not None and train_step is None:
        raise TypeError("eval_step needs train_step (the default step evaluates loss and metrics= itself)")
    if train_step is not None and (metrics is not None or loss is not None):
        raise TypeError(
            "loss= and metrics= belong to the default step; with train_step, compute the loss there "
            "and return metrics from eval_step"
        )


_FORMS = {
    "xy": "(X, y) arrays (or data read as them: a DataFrame, an xarray or Zarr dataset)",
    "dict": "a dict of arrays (or an xarray / Zarr dataset read per variable for a train_step)",
    "dataset": "a torch Dataset",
}


def check_same_form(train: PreparedData, val: PreparedData) -> None:
    """Validation batches are made as the training's are: of the same kind of data."""
    if val.form == train.form:
        return
    hint = ""
    if train.form == "dataset":
        hint = ": arrays as torch.utils.data.TensorDataset(torch.as_tensor(X_val), torch.as_tensor(y_val))"
    raise DataError(
        f"validation is {_FORMS[val.form]} but the training data is {_FORMS[train.form]}; give validation data of "
        f"the training's kind{hint}, or a fraction of the training data to hold out (validation=0.1)"
    )


def check_label_kind(train: PreparedData, val: PreparedData) -> None:
    """Validation labels are cast as the training's are (class ids or the model's dtype): refuse the other kind,
    whose float class ids would be truncated (0.6 -> 0) or out of range on the workers."""
    if train.y_dtype is None or val.y_dtype is None or train.classification == val.classification:
        return
    kinds = {True: "integer class ids (classification)", False: "floats (regression)"}
    fix = "y_val.astype('int64') when they are whole class ids" if train.classification else "y_val.astype('float32')"
    raise DataError(
        f"validation labels are {np.dtype(val.y_dtype)}, {kinds[val.classification]}, but the training labels "
        f"are {np.dtype(train.y_dtype)}, {kinds[train.classification]}; validation labels must be of the "
        f"training's kind: {fix}"
    )
