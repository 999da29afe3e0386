"""The pre-flight check that runs the model once on a few rows of the data: :func:`check_model`.

It says what to do when the model cannot take the data, returns something other than one tensor, outputs fewer
classes than the labels hold, or when the loss or a metric cannot compare its outputs with the labels; it also
warns when the classes may lie along either of two axes.  The names it shares with :mod:`vcdask.preflight`
(the class-id losses, the shapes written with their sample axis as ``n``) live here, below it; ``preflight``
re-exports :func:`check_model` and :func:`describe_output`, where :func:`vcdask.options.plan` imports them.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._stack import user_level
from .device import cpu_copy
from .dtype_kinds import string_labels_error
from .errors import DataError
from .metrics import ambiguous_axis, class_axis, unwrapped

if TYPE_CHECKING:
    from .prepared import PreparedData

__all__ = ["check_model", "describe_output"]


# the built-in losses that take class ids (float targets only as class probabilities shaped like the outputs)
_CLASS_LOSSES = {"cross_entropy": torch.nn.functional.cross_entropy, "nll": torch.nn.functional.nll_loss}
# torch's losses that take float labels shaped like the outputs (a regression's values, one logit per label)
_F = torch.nn.functional
_FLOAT_LOSSES: tuple[Any, ...] = (_F.mse_loss, _F.l1_loss, _F.huber_loss, _F.smooth_l1_loss)
_FLOAT_LOSSES += (_F.binary_cross_entropy, _F.binary_cross_entropy_with_logits)
_FLOAT_LOSS_MODULES: tuple[type, ...] = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.HuberLoss, torch.nn.SmoothL1Loss)
_FLOAT_LOSS_MODULES += (torch.nn.BCELoss, torch.nn.BCEWithLogitsLoss)


def check_model(
    model,
    prepared: PreparedData,
    loss,
    classification: bool,
    x_dtype,
    what: str = "training",
    metrics=None,
    strict: Collection[str] = (),
) -> bool:
    """One forward pass on a few rows: the model accepts the data and its outputs fit the labels and the loss
    (one number for the batch: a scalar tensor) and ``metrics`` (name -> fn(output, target)) can compare them
    (``what``: the ``"training"`` or ``"validation"`` data, as the messages name it).  A metric named in
    ``strict`` (vcdask's own) that fails is refused; another (the user's, which may need more rows than these)
    is warned of.  Outputs that are not one tensor (a tuple, a dict) are refused: the default step cannot tell
    which to train on.

    Returns whether ``X`` is cast to the model's dtype (True), or stays integer (False: integer
    inputs such as token ids that the model takes as they are, and not as floats).
    """
    probe = cpu_copy(model).eval()  # (the probe rows are CPU tensors, whatever device the model is on)
    if prepared.form == "dataset":
        if prepared.sample_X is None:
            sample = prepared.sample  # (items (x, "cat"): a batch of x and a list of strings)
            labels = sample[1] if isinstance(sample, (tuple, list)) and len(sample) == 2 else ()
            if isinstance(labels, (tuple, list)) and labels and all(isinstance(v, str) for v in labels):
                fix = "; in the Dataset, __getitem__ returns the code: (x, codes[i]) or (x, classes.index(label))"
                raise string_labels_error(np.asarray(labels, dtype=object), "the dataset's labels", fix)
            raise DataError(
                "the default step needs dataset items (x, y) of tensors; pass train_step=fn(model, batch) "
                "(and eval_step=) for other items"
            )
        X = torch.as_tensor(prepared.sample_X)
        X, cast = (X.to(x_dtype), True) if X.is_floating_point() else (X, False)
    else:
        X = torch.as_tensor(np.ascontiguousarray(prepared.sample_X))
        cast = True
    try:
        with torch.no_grad():
            out = probe(X.to(x_dtype) if cast else X)
    except Exception as e:  # noqa: BLE001 - the user's model; retried with integer inputs, else reported
        integer = not X.is_floating_point() and cast
        try:
            if not integer:
                raise
            with torch.no_grad():  # integer inputs (token ids...) the model takes as they are
                out, cast = probe(X), False
        except Exception:  # noqa: BLE001 - reported with the first error
            fed = _name(x_dtype) if cast else _name(X.dtype)
            given = str(prepared.x_dtype).removeprefix("torch.")
            how = f", fed to the model as {fed} (the dtype of most of its parameters)" if fed != given else ""
            raise DataError(
                f"the model cannot process the {what} data: samples of shape {tuple(prepared.x_shape)} "
                f"and dtype {prepared.x_dtype}{how} -> {type(e).__name__}: {e}"
            ) from e
    if not isinstance(out, torch.Tensor):  # (a tuple, a dict: the user's step picks the output to train on)
        raise DataError(
            f"the default step computes loss(model(X), y) and needs the model to return one tensor, but it returns "
            f"{describe_output(out)}; pass train_step=fn(model, batch) -> loss that picks the output to train on "
            "(x, y = batch; logits, _ = model(x); return loss(logits, y)) and eval_step=fn(model, batch) -> dict "
            "of metrics, or have the model's forward return the one tensor"
        )
    y = torch.as_tensor(np.ascontiguousarray(prepared.sample_y))
    y = y.long() if classification else y.to(x_dtype)
    if classification and _float_loss(loss) is not None:  # (torch's raw "Float can't be cast to ... Long")
        raise DataError(_integer_labels(prepared, what, out, y, f"loss={_float_loss(loss)} takes float labels"))
    if classification:
        axis = class_axis(out.shape, y.shape)  # (scores per class along axis 1 of (n, C, T): cross_entropy's)
        n_classes = out.shape[axis] if axis is not None else out.shape[-1] if out.dim() > 1 else 1
        label_range = prepared.label_range
        assert label_range is not None  # set for classification data
        lo, hi = label_range
        if lo < 0 or hi >= n_classes:
            hint = (
                " (bool labels are two classes, False 0 and True 1: give the model 2 outputs, or for a regression "
                "on one output pass float labels, y.astype('float32'))"
                if prepared.bool_labels
                else ""
            )
            if n_classes == 1:  # one output: meant for a regression, or one logit per label (what to do instead)
                said = _integer_labels(prepared, what, out, y, "the model has one output per sample")
                hint = f"{hint}. {said[0].upper()}{said[1:]}"
            if out.dim() > 2 and axis == 1:  # a class per position: say which axis holds the classes
                shapes = f"outputs {_shape(tuple(out.shape))} against labels {_shape(tuple(y.shape))}"
                hint += f" (the classes lie along axis 1 of {shapes}, as cross_entropy reads them)"
            raise DataError(
                f"{what} labels range over [{lo}, {hi}] but the model outputs "
                f"{n_classes} classes; labels must be in [0, {n_classes - 1}]{hint}"
            )
    class_loss = any(unwrapped(loss) is fn for fn in _CLASS_LOSSES.values()) or isinstance(
        unwrapped(loss), (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)
    )
    if classification and not class_loss and ambiguous_axis(out.shape, y.shape):  # (n, C, T) with C == T
        shapes = f"outputs {_shape(tuple(out.shape))} against labels {_shape(tuple(y.shape))}"
        warnings.warn(
            f"the classes of {shapes} may lie along axis 1 or along the last axis; accuracy, predict and "
            "predict_proba read axis 1, as cross_entropy does: if your loss reads the last axis, have the model "
            "return its outputs as (n, classes, positions) (out.transpose(1, 2)), or pass metrics of your own",
            stacklevel=user_level(),
        )
    try:
        value = loss(out, y)
    except Exception as e:
        hint = ""
        if out.shape != y.shape and out.numel() == y.numel() and out.dim() > 1:  # (n, 1) outputs, (n,) labels
            shape = ", ".join(str(d) for d in (-1, *out.shape[1:]))
            hint = f"; if the loss takes labels shaped like the outputs, give them that shape: y.reshape({shape})"
        column = classification and y.dim() == 2 and y.shape[1] == 1 and out.dim() == 2
        if column and (class_loss or "multi-target" in str(e)):  # (torch's "0D or 1D target tensor expected")
            hint += (
                "; integer labels of shape (n, 1) are class ids as a column: pass them as (n,), y.ravel() "
                "(or y[:, 0]), as the loss takes them"
            )
        elif classification and not class_loss:
            hint += (
                f"; the labels are integers ({_name(y.dtype)}), which vcdask takes as class ids: for a regression "
                "or one logit per label, pass float labels, y.astype('float32')"
            )
        raise DataError(
            f"the loss cannot compare model outputs of shape {tuple(out.shape)} with labels of "
            f"shape {tuple(y.shape)}: {type(e).__name__}: {e}{hint}"
        ) from e
    if not isinstance(value, torch.Tensor) or value.numel() != 1:  # (backward needs one number for the batch)
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise DataError(
            f"the loss must return one number for the batch (a scalar tensor), but returns {got} for {len(y)} "
            "samples: with reduction='none', pass reduction='mean' (the default) or 'sum'; a function of yours "
            "returns the batch's mean (its .mean()) as a tensor"
        )
    # A NaN loss on these few rows, in eval mode, proves nothing alone (a loss masked to rows these are not, batch
    # statistics a bad checkpoint's running_var spoils in eval mode only: training goes on): refused when the
    # parameters hold NaN/inf, or when the loss is NaN in train mode on more rows too; else every update would be
    # NaN, and the run would fail on the cluster after no_worker_timeout, blaming its workers.
    if what == "training" and not torch.isfinite(value).all():
        bad = [n for n, p in model.named_parameters() if not _finite(p)]
        if bad:
            raise DataError(
                f"the model's parameters hold non-finite values (NaN/inf) in {bad[:5]}{' ...' if len(bad) > 5 else ''}"
                ": its outputs and every update would be NaN; initialize them again (or load a checkpoint saved before "
                "they diverged)"
            )
        from .steps import check_default_loss

        check_default_loss(model, (prepared, x_dtype), loss)  # (in train mode, on more rows too)
    for name, fn in (metrics or {}).items():  # (a metric that fails here failed the run's first validation)
        try:
            float(fn(out.float(), y))
        except Exception as e:
            message = (
                f"metric {name!r} cannot compare model outputs of shape {tuple(out.shape)} with labels of "
                f"shape {tuple(y.shape)} (as validation gives them: outputs as float32): {type(e).__name__}: {e}"
            )
            if name not in strict:
                # a function of the user's may need more than these few rows (both classes, say): said, not refused
                warnings.warn(
                    f"{message}; on these {len(y)} rows only: the run's validation fails if it does",
                    stacklevel=user_level(),
                )
                continue
            raise DataError(message) from e
    return cast


def _float_loss(loss: Any) -> str | None:
    """How ``loss`` reads in a message when it is one of torch's losses of float labels (:data:`_FLOAT_LOSSES`,
    :data:`_FLOAT_LOSS_MODULES`, also in a :func:`functools.partial`); else None."""
    fn = unwrapped(loss)
    if isinstance(fn, _FLOAT_LOSS_MODULES):
        return f"torch.nn.{type(fn).__name__}()"
    return f"torch.nn.functional.{fn.__name__}" if any(fn is f for f in _FLOAT_LOSSES) else None


def _integer_labels(prepared: PreparedData, what: str, out: torch.Tensor, y: torch.Tensor, why: str) -> str:
    """The message for integer labels (class ids to vcdask) given to a model or a loss of float labels (``why``):
    the remedies, float labels shaped like the outputs, or a classifier of one output per class."""
    lo, hi = prepared.label_range or (int(y.min()), int(y.max()))
    kind = "bool (False 0, True 1)" if prepared.bool_labels else f"integers ({_name(y.dtype)})"
    floats = "float labels, y.astype('float32')"
    if out.shape != y.shape and out.numel() == y.numel():
        floats += f", shaped like the outputs: y.reshape({', '.join(map(str, (-1, *out.shape[1:])))})"
    if lo < 0:
        classifier = "a classifier takes class ids 0..C-1"
    else:
        each = " per label" if y.dim() > 1 else ""
        classifier = (
            f"for a classifier, give the model {hi + 1} outputs{each} (one per class 0..{hi}) and leave loss= unset "
            "(cross-entropy)"
        )
    shapes = f"outputs {_shape(tuple(out.shape))} against labels {_shape(tuple(y.shape))}"
    if why.startswith("loss="):  # (the loss says the labels are floats: that remedy first)
        remedy = f"For a regression or one logit per label, pass {floats}; {classifier}"
    else:
        logit = "one logit per label (loss=torch.nn.BCEWithLogitsLoss())"
        remedy = f"{classifier[0].upper()}{classifier[1:]}; for a regression, or {logit}, pass {floats}"
    return (
        f"the {what} labels are {kind}, over [{lo}, {hi}], which vcdask takes as class ids (a classifier: one output "
        f"per class, cross-entropy), but {why} ({shapes}). {remedy}"
    )


def describe_output(out: Any) -> str:
    """What a model returned, for a message: ``"a tuple of 2 (Tensor, Tensor)"``, ``"a dict with keys ['logits']"``."""
    if isinstance(out, (tuple, list)):
        kinds = ", ".join(type(o).__name__ for o in out[:4]) + (", ..." if len(out) > 4 else "")
        return f"a {type(out).__name__} of {len(out)} ({kinds})"
    if isinstance(out, Mapping):
        return f"a {type(out).__name__} with keys {list(out)[:6]}"
    return f"a {type(out).__module__}.{type(out).__qualname__}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_N = 7919  # a stand-in for the sample count n in shapes (a prime no model's axis is likely to have)


def _shape(shape: tuple[int, ...]) -> str:
    """A batch shape with its sample axis as ``n``: ``(4, 1) -> "(n, 1)"`` (and ``_N`` anywhere as ``n``)."""
    dims = ["n", *("n" if d == _N else str(d) for d in shape[1:])]
    return "(" + ", ".join(dims) + ("," if len(shape) == 1 else "") + ")"


def _finite(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex()) or bool(torch.isfinite(t).all())
