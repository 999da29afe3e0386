"""What a run's outputs and metrics mean: the one rule that reads class ids from a model's outputs, and the names
of the numbers a run reports.

A classifier's scores per class lie along its outputs' last axis, ``(n, C)`` against labels ``(n,)``, or along
axis 1 for a classifier per position, ``(n, C, T)`` against labels ``(n, T)``: the layout
:func:`torch.nn.functional.cross_entropy` reads (:func:`class_axis`; the last axis of ``(n, T, V)`` outputs, where
only it leaves the labels' shape, as a language model's loss that flattens them reads it).  A binary classifier of
one logit per label (outputs ``(n, 1)`` or ``(n,)`` against 0/1 labels, trained with
:func:`~torch.nn.functional.binary_cross_entropy_with_logits`) says class 1 where its logit is above 0.
:func:`class_ids` applies both, for the ``accuracy``, ``mae`` and ``mse`` metrics and for
:meth:`FitResult.predict <vcdask.FitResult.predict>` alike.

A run's validation numbers become the columns of ``FitResult.epochs``, beside the columns every epoch row has
(:data:`EPOCH_COLUMNS`) and each number's ``_mean``, ``_min`` and ``_max`` over the epoch
(:data:`DERIVED_SUFFIXES`): :func:`check_metric_names` refuses a name that would overwrite another's column.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "BOUNDS",
    "DERIVED_SUFFIXES",
    "EPOCH_COLUMNS",
    "LOGIT_LOSSES",
    "ambiguous_axis",
    "check_accuracy",
    "check_metric_names",
    "class_axis",
    "class_ids",
    "label_shape",
    "metric_bounds",
    "metric_name",
    "one_logit",
    "unwrapped",
]

#: The columns every row of ``FitResult.epochs`` has (:meth:`vcdask.engine.ledger.Ledger._epoch_row`); a metric
#: of one of these names would overwrite it.
EPOCH_COLUMNS = ("epoch", "version", "wall_time", "train_loss", "skipped")
#: The columns ``FitResult.epochs`` derives from each validation number (``loss_min``, ``accuracy_max``...).
DERIVED_SUFFIXES = ("_mean", "_min", "_max")
#: The losses that train one logit per label: its class is 1 where the logit is above 0.
LOGIT_LOSSES = (torch.nn.functional.binary_cross_entropy_with_logits,)


def class_axis(out_shape: Sequence[int], target_shape: Sequence[int]) -> int | None:
    """The axis of a classifier's scores per class in outputs of shape ``out_shape`` against labels of
    ``target_shape``: the last axis of ``(n, C)`` outputs; of ``(n, C, T, ...)`` ones (a class per position), axis 1,
    as :func:`torch.nn.functional.cross_entropy` reads them, unless only the last axis leaves the labels' shape
    (``(n, T, V)`` against ``(n, T)``: a language model whose loss flattens its outputs); None when the outputs have
    the labels' axes (one score per label).  A last label axis of size 1 beside outputs of the labels' rank
    (``(n, C)`` against ``(n, 1)``: a loss that squeezes the labels) is taken as absent.

    Examples
    --------
    >>> class_axis((32, 10), (32,)), class_axis((32, 3, 6), (32, 6)), class_axis((32, 8, 16), (32, 8))
    (-1, 1, -1)
    >>> class_axis((32, 10), (32, 1)), class_axis((32, 4), (32, 4))
    (-1, None)
    """
    out_shape, target_shape = tuple(out_shape), _class_target(out_shape, target_shape)
    if len(out_shape) != len(target_shape) + 1:
        return None
    if len(out_shape) > 2 and out_shape[2:] != target_shape[1:] and out_shape[1:-1] == target_shape[1:]:
        return -1
    return 1 if len(out_shape) > 2 else -1


def _class_target(out_shape: Sequence[int], target_shape: Sequence[int]) -> tuple[int, ...]:
    """``target_shape`` as the classes are read against it: without a last axis of size 1 where the outputs have
    the labels' rank (labels ``(n, 1)`` beside outputs ``(n, C)`` are ``(n,)``)."""
    target_shape = tuple(target_shape)
    if len(target_shape) > 1 and target_shape[-1] == 1 and len(tuple(out_shape)) == len(target_shape):
        return target_shape[:-1]
    return target_shape


def ambiguous_axis(out_shape: Sequence[int], target_shape: Sequence[int]) -> bool:
    """Whether both axis 1 and the last axis of outputs ``out_shape`` leave the labels' ``target_shape``
    (``(n, C, T)`` with ``C == T``): :func:`class_axis` reads axis 1 then, as ``cross_entropy`` does."""
    out_shape, target_shape = tuple(out_shape), _class_target(out_shape, target_shape)
    return (
        len(out_shape) > 2
        and len(out_shape) == len(target_shape) + 1
        and out_shape[2:] == out_shape[1:-1] == target_shape[1:]
    )


def class_ids(output: torch.Tensor, target_shape: Sequence[int]) -> torch.Tensor:
    """The class ids (int64) that ``output`` predicts for labels of shape ``target_shape``, shaped as the labels.

    Scores per class (:func:`class_axis`): their arg-max.  One score per label, whether the outputs have the
    labels' axes or one axis more of size 1 (``(n, 1)`` against ``(n,)``): a logit, class 1 where it is above 0.
    """
    axis = class_axis(output.shape, target_shape)
    if axis is None:
        ids = (output > 0).long()
    elif output.shape[axis] != 1:
        ids = output.argmax(dim=axis)
    else:
        ids = (output.squeeze(axis) > 0).long()
    target_shape = tuple(target_shape)  # (labels (n, 1) beside (n, C) outputs: ids (n,), shaped as them)
    return ids.reshape(target_shape) if ids.shape != target_shape and ids.numel() == math.prod(target_shape) else ids


#: The ranges of vcdask's metrics that have one (by their name in :data:`vcdask.options.METRICS`): a target out of
#: it can never be reached (:func:`metric_bounds`).
BOUNDS = {"accuracy": (0.0, 1.0), "mae": (0.0, math.inf), "mse": (0.0, math.inf)}


def metric_bounds(metrics: Mapping[str, Callable]) -> dict[str, tuple[float, float]]:
    """The range of each metric of ``metrics`` (reported name -> fn) that is one of vcdask's own (a function of
    :data:`vcdask.options.METRICS`, also in a :func:`functools.partial`) with a range in :data:`BOUNDS`.

    Examples
    --------
    >>> from vcdask.options import accuracy, mae
    >>> metric_bounds({"acc": accuracy, "mae": mae, "mine": print})
    {'acc': (0.0, 1.0), 'mae': (0.0, inf)}
    """
    ours = {name: fn for name, fn in metrics.items() if getattr(unwrapped(fn), "__module__", None) == "vcdask.options"}
    return {
        name: BOUNDS[fn.__name__] for name, fn in ((n, unwrapped(f)) for n, f in ours.items()) if fn.__name__ in BOUNDS
    }


def unwrapped(fn: Any) -> Any:
    """``fn`` without the :func:`functools.partial` layers around it (``partial(F.binary_cross_entropy_with_logits,
    pos_weight=w)``: the function), as a loss is told by what it computes."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def one_logit(loss: Any) -> bool:
    """Whether ``loss`` trains one logit per label (:data:`LOGIT_LOSSES`, or a
    :class:`torch.nn.BCEWithLogitsLoss`, also in a :func:`functools.partial`): its outputs are a binary
    classifier's."""
    loss = unwrapped(loss)
    return any(loss is fn for fn in LOGIT_LOSSES) or isinstance(loss, torch.nn.BCEWithLogitsLoss)


def check_accuracy(names: list[str], loss: Any, classification: bool) -> None:
    """Refuse vcdask's ``accuracy`` (reported under ``names``) on float labels unless the loss trains one logit
    per label (:func:`one_logit`): another loss's outputs (probabilities, a regression's values) have no
    threshold it can tell.

    Raises
    ------
    ValueError
        Naming the loss, and the remedies.
    """
    if not names or classification or one_logit(loss):
        return
    raise ValueError(
        f"metric {names[0]!r} counts the labels the outputs predict, but the labels are floats (a regression) and "
        f"the loss {metric_name(loss)!r} gives no class to read from the outputs; for a classifier, give integer "
        "class ids (y.astype('int64')) and a model with one output per class, or train one logit per label with "
        "loss=torch.nn.functional.binary_cross_entropy_with_logits (class 1 where it is above 0); else pass "
        "metrics='mae' or a metric of your own"
    )


def label_shape(prepared: Any) -> tuple[int, ...] | None:
    """The shape of one sample's label in ``prepared`` (a :class:`~vcdask.prepared.PreparedData`): ``()`` for
    labels ``(n,)``; None for data without labels of their own (dict batches)."""
    if prepared.form == "xy" and prepared.sample_y is not None:
        return tuple(prepared.sample_y.shape[1:])
    sample = prepared.sample if prepared.form == "dataset" else None
    if isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[1], torch.Tensor):
        return tuple(sample[1].shape[1:])
    return None


def metric_name(fn: Callable) -> str:
    """The name a metric given without one reports under: a function's ``__name__``; a
    :func:`functools.partial`'s function with its arguments, ``"topk(k=3)"``; another callable's class."""
    if isinstance(fn, functools.partial):
        args = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"{metric_name(fn.func)}({', '.join(args)})"
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) and name else type(fn).__name__


def check_metric_names(names: Iterable[Any], what: str = "metrics=", *, loss: bool = False) -> list[str]:
    """``names`` (the metrics a run's validation reports besides ``"loss"``; with it, when ``loss``: an
    ``eval_step``'s) checked against each other and the columns of ``FitResult.epochs``; returns them.

    ``what`` names where they come from in the messages: ``"metrics="`` or ``"eval_step"``.

    Raises
    ------
    TypeError
        A name that is not a non-empty string.
    ValueError
        A name given twice, one of :data:`EPOCH_COLUMNS` (or ``"loss"``, the validation loss vcdask reports
        itself, unless ``loss``), or a name with a suffix of :data:`DERIVED_SUFFIXES` that another number's
        column has already (``"loss_min"``); the message names it and the names taken.
    """
    names = list(names)
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{what}: metric names must be non-empty strings, got {name!r}")
    fix = "name them with a dict, metrics={'name': fn, ...}" if what == "metrics=" else "return them under other names"
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{what} names two metrics {name!r}: one would replace the other; {fix}")
        seen.add(name)
    reserved = {*EPOCH_COLUMNS, *(() if loss else ("loss",))}
    bases = {*names, *(() if loss else ("loss",))}
    for name in names:
        base = next((name[: -len(s)] for s in DERIVED_SUFFIXES if name.endswith(s) and name[: -len(s)] in bases), None)
        if name in reserved or base is not None:
            if base is not None:
                taken = f"the {name[len(base) + 1 :]} of {base!r} over an epoch, a column FitResult.epochs derives"
            elif name == "loss":
                taken = "the validation loss vcdask reports itself"
            else:
                taken = "a column of every row of FitResult.epochs"
            raise ValueError(
                f"{what} names a metric {name!r}, which would replace {taken}; give it another name (taken: "
                f"{sorted(reserved)}, and {'/'.join(DERIVED_SUFFIXES)} after the name of any metric reported)"
            )
    return names
