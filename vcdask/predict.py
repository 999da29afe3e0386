"""Using a trained model: :meth:`FitResult.predict` and :meth:`FitResult.predict_proba`.

The rows go through the model in batches, without gradients, in eval mode, on one device; inputs are
read the way the run read its training data (a DataFrame's feature columns, or an xarray Dataset's feature
variables, selected by the names the run recorded, as float32; arrays cast to the model's dtype as it is now,
unless the run kept integer inputs), and the outputs come back as numpy.  A classifier's class ids and
probabilities are read from its outputs as its ``accuracy`` reads them (:func:`vcdask.metrics.class_ids`).
Threads may predict with one model at once (a threaded model server): each call holds the model's lock while it
has the model in eval mode, so the others wait, and each gets the answer it would get alone.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any

import numpy as np
import torch

from .device import check_device, cpu_copy, resolve_device, same_device
from .errors import DataError
from .metrics import class_axis, class_ids, one_logit
from .preflight import describe_output, model_dtype

__all__ = ["binary_classifier", "check_class_scores", "label_logits", "model_outputs", "predicted", "probabilities"]

# One lock per model predicted with in place: a prediction sets the model's modules to eval mode and sets each
# back after, so two at once on one model (a threaded model server) would see each other's modes (dropout on,
# batch norm updating its running statistics) and could leave the model in the other's mode.
_model_locks: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_model_locks_guard = threading.Lock()


def _lock_for(model: torch.nn.Module) -> threading.RLock:
    """The lock held while ``model`` predicts in place (made on first use; goes with the model)."""
    with _model_locks_guard:
        lock = _model_locks.get(model)
        if lock is None:
            lock = _model_locks[model] = threading.RLock()
        return lock


def model_outputs(
    model: torch.nn.Module, spec: Any, X: Any, *, batch_size: int = 1024, device: Any = None
) -> torch.Tensor:
    """The model's outputs for the rows of ``X``, on the CPU (one forward pass per ``batch_size`` rows).

    Parameters
    ----------
    model : torch.nn.Module
        The trained model (left in the mode and on the device it was: another device gets a copy).  Calls from
        several threads with one model take turns (a lock per model, held while it is in eval mode).
    spec : RunSpec
        The run's spec: its batch form, feature columns, whether it kept integer inputs.  Floating rows
        (and integer ones, unless the run kept them) take the dtype of the model's first floating parameter,
        as it is now (``model.double()`` after the run: float64).
    X : numpy array, torch tensor, pandas DataFrame, xarray Dataset or array-like
        The rows, sample axis first (a Dataset's feature variables, one value per sample each).
    batch_size : int, default 1024
    device : {"auto", "cpu", "cuda", "cuda:N", "mps"} or torch.device, optional
        Where to run the model, as ``fit``'s ``device=`` in this process (``"auto"``: its accelerator if it
        has one, else the CPU); default where ``model`` is (the CPU for a finished run's model).

    Raises
    ------
    TypeError
        A run whose batches are dicts (a custom ``train_step``), a model whose outputs are not one tensor (a
        tuple, a dict), or an unsupported input.
    ValueError
        ``device`` names no kind of device (the message lists the valid ones).
    RuntimeError
        ``device`` names a device this process does not have.
    DataError
        The model cannot take the rows (their shape and dtype are named), or a DataFrame lacks a column (a
        Dataset a variable).
    """
    from ._ints import positive_int
    from .batches import cast_like_training

    batch_size = positive_int("batch_size", batch_size)
    if spec.batch_form == "dict":
        raise TypeError(
            "this run trained on dict batches with a custom train_step, so predict cannot tell how to call the "
            "model; call result.model yourself (result.model.eval(); with torch.no_grad(): result.model(...))"
        )
    x = _rows(X, spec)
    where = next((p.device for p in model.parameters()), torch.device("cpu"))
    target = where if device is None else resolve_device(check_device(device), where="this process")
    if same_device(target, where):
        net = model
    else:  # (a copy; to the CPU without a second one on the model's GPU)
        net = cpu_copy(model) if target.type == "cpu" else copy.deepcopy(model).to(target)
    x = cast_like_training(x, spec, dtype=_dtype(net))  # (the model's dtype now: it may have been cast since)
    # the model's own modes are set and restored under its lock: other threads predicting with it wait (a copy
    # is this call's own, but lock it all the same: cheap, and one path)
    with _lock_for(net):
        outs = _forward(net, x, batch_size, target)
    if not outs:
        raise DataError("X is empty (0 rows)")
    return torch.cat(outs)


def _forward(net: torch.nn.Module, x: torch.Tensor, batch_size: int, target: torch.device) -> list[torch.Tensor]:
    """``net``'s outputs for ``x``, batch by batch, on the CPU: in eval mode, each module's mode restored after
    (a frozen batch norm stays in eval); the caller holds ``net``'s lock."""
    modes = [(m, m.training) for m in net.modules()]
    net.eval()
    outs = []
    try:
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                batch = x[start : start + batch_size].to(target)
                try:
                    out = net(batch)
                except torch.OutOfMemoryError as e:  # not the data's fault: say what to change
                    raise torch.OutOfMemoryError(
                        f"out of memory on {target} predicting batches of {batch_size} rows: pass a smaller "
                        f"batch_size= (or device='cpu'). {e}"
                    ) from e
                except Exception as e:
                    raise DataError(
                        f"the model cannot process X: rows of shape {tuple(x.shape[1:])} and dtype {x.dtype} "
                        f"-> {type(e).__name__}: {e}"
                    ) from e
                if not isinstance(out, torch.Tensor):  # (a custom train_step's model: it knew what to pick)
                    raise TypeError(
                        f"predict and predict_proba need the model to return one tensor of outputs, but it returns "
                        f"{describe_output(out)}; call result.model directly (result.model.eval(); with "
                        "torch.no_grad(): out = result.model(torch.as_tensor(X))) and take the output you need"
                    )
                # (numpy has no bfloat16: such outputs come back as float32)
                outs.append(out.detach().cpu().float() if out.dtype == torch.bfloat16 else out.detach().cpu())
    finally:
        for m, mode in modes:
            m.training = mode
    return outs


def _dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype ``model`` takes its floating inputs in now (it may have been cast since the run): the one most
    of its floating parameters' elements hold (:func:`~vcdask.preflight.model_dtype`, the rule the run's
    ``x_dtype`` was chosen by), else its first floating buffer's; None for a model with neither."""
    if any(p.is_floating_point() for p in model.parameters()):
        return model_dtype(model)
    return next((b.dtype for b in model.buffers() if b.is_floating_point()), None)


def _label_shape(out: torch.Tensor, spec: Any) -> tuple[int, ...]:
    """The shape of the labels the run trained on, for ``len(out)`` rows (a run recorded before
    ``label_shape``: a classifier's labels lack the outputs' class axis, axis 1 of ``(n, C, T)`` outputs; a
    binary classifier's have the outputs' shape)."""
    shape = getattr(spec, "label_shape", None)
    if shape is not None:
        return (len(out), *shape)
    if not spec.classification:
        return tuple(out.shape)
    return (len(out), *out.shape[2:]) if out.dim() > 2 else tuple(out.shape[:-1])


def binary_classifier(spec: Any) -> bool:
    """Whether the run trained one logit per label: float labels, a loss of :func:`vcdask.metrics.one_logit`."""
    return not spec.classification and one_logit(spec.loss)


def label_logits(out: torch.Tensor, spec: Any) -> bool:
    """Whether ``out`` are a ``train_step``'s logits, one per label, for integer labels of 0 and 1 (the spec's
    ``label_range``): outputs in the labels' shape, or ``(n, 1)`` against ``(n,)``; a binary classifier of one logit
    or a multi-label one trained with ``binary_cross_entropy_with_logits`` on 0/1 integers.  They are read as the
    default step's one-logit runs' are (:func:`binary_classifier`): class 1 where above 0, the sigmoid."""
    if not spec.classification or getattr(spec, "train_step", None) is None:
        return False
    lo, hi = spec.label_range or (-1, -1)
    axis = class_axis(out.shape, _label_shape(out, spec))
    return 0 <= lo and hi <= 1 and (axis is None or out.shape[axis] == 1)


def check_class_scores(out: torch.Tensor, spec: Any) -> None:
    """Refuse to read class ids from the outputs ``out`` of a run that trained a ``train_step`` on integer labels
    unless they hold scores per class for those labels: a class axis (:func:`vcdask.metrics.class_axis`) of more
    than one column, and one beyond the largest id (the spec's ``label_range``; a run written before it: the column),
    or for labels of 0 and 1, one logit per label (:func:`label_logits`).

    The default step checked this before the run (its labels lie in ``[0, number of outputs)``); a ``train_step``'s
    loss is its own, and integer labels are not always class ids: a count regression (``poisson_nll_loss`` on
    counts, one output), several integer targets (outputs in the labels' shape).  Class ids read from such outputs
    were silently wrong (the arg-max of one column is 0; a threshold at 0 of a count's log-rate is 1).  On labels of
    0 and 1 only, one output per label is a binary or multi-label classifier's logit (a count regression on 0/1
    labels is not told apart from it).

    Raises
    ------
    TypeError
        The outputs are not scores per class for the labels (what to call instead named).
    """
    if not spec.classification or getattr(spec, "train_step", None) is None:
        return
    labels = _label_shape(out, spec)
    axis = class_axis(out.shape, labels)
    largest = (spec.label_range or (0, 0))[1]
    if (axis is not None and out.shape[axis] > max(1, largest)) or label_logits(out, spec):
        return
    per_row, label_row = tuple(out.shape[1:]), tuple(labels[1:])
    seen = f", class ids up to {largest}" if largest else ""
    raise TypeError(
        f"this run trained with a train_step on integer labels, but its outputs (shape {per_row} per row, against "
        f"labels of shape {label_row}{seen}) are not scores per class for them (one column per class, more than "
        "one), so predict and predict_proba cannot read classes from them (a regression on integer targets, such "
        "as counts, or one logit per label?). For the outputs, call the model yourself (result.model.eval(); with "
        "torch.no_grad(): out = result.model(torch.as_tensor(X))), or train on float labels (y.astype('float32')): "
        "predict then returns the outputs as they are"
    )


def predicted(out: torch.Tensor, spec: Any) -> np.ndarray:
    """What :meth:`FitResult.predict` returns for the outputs ``out``: a classifier's class ids (int64, shaped as
    the labels, :func:`vcdask.metrics.class_ids`), else the outputs as they are.

    Raises
    ------
    TypeError
        A ``train_step``'s run on integer labels whose outputs are not scores per class (:func:`check_class_scores`).
    """
    check_class_scores(out, spec)
    if spec.classification or binary_classifier(spec):
        return class_ids(out, _label_shape(out, spec)).numpy()
    return out.numpy()


def probabilities(out: torch.Tensor, spec: Any) -> np.ndarray:
    """What :meth:`FitResult.predict_proba` returns for a classifier's outputs ``out``: the softmax along the
    class axis (:func:`vcdask.metrics.class_axis`: the last, or axis 1 of a classifier per position's); for one
    logit per sample, the columns P(class 0), P(class 1) of its sigmoid; for several logits per sample (several
    binary labels), the sigmoid of each (a default step's run of :func:`binary_classifier`, or a ``train_step``'s
    of :func:`label_logits`).

    Raises
    ------
    TypeError
        A ``train_step``'s run on integer labels whose outputs are not scores per class (:func:`check_class_scores`).
    """
    check_class_scores(out, spec)
    out = out.float()
    if spec.classification and not label_logits(out, spec):
        axis = class_axis(out.shape, _label_shape(out, spec))
        return torch.softmax(out, dim=-1 if axis is None else axis).numpy()
    p = torch.sigmoid(out)
    if out.dim() == 1 or out[0].numel() == 1:
        p = p.reshape(-1)
        return torch.stack([1 - p, p], dim=1).numpy()
    return p.numpy()


def _rows(X: Any, spec: Any) -> torch.Tensor:
    """``X`` as a CPU tensor, a DataFrame's columns picked as the run picked them."""
    from .frames import frame_features, is_frame

    if type(X).__name__ == "Dataset" and type(X).__module__.startswith("xarray"):
        X = _dataset_frame(X, spec)
    if is_frame(X):
        names = list(spec.feature_names) or list(X.columns)
        missing = [c for c in names if c not in X.columns]
        if missing:
            raise DataError(
                f"X lacks the feature column(s) {missing} the run trained on; it trained on {names} "
                f"(X's columns: {list(X.columns)})"
            )
        return torch.from_numpy(frame_features(X, names, "X")[0])
    if isinstance(X, torch.Tensor):
        return X.detach().cpu()
    if type(X).__module__.startswith("dask") or hasattr(X, "__dask_graph__"):
        raise TypeError("predict takes in-memory rows; call X.compute() (or predict chunk by chunk) first")
    try:
        a = np.asarray(X)
    except Exception as e:
        raise TypeError(f"X must be a numpy array, torch tensor or pandas DataFrame, got {type(X).__name__}") from e
    if a.dtype.kind not in "biuf" or a.ndim == 0:
        raise TypeError(
            f"X must be numeric rows (a numpy array, torch tensor or pandas DataFrame), got {type(X).__name__} "
            f"of dtype {a.dtype} and shape {a.shape}"
        )
    return torch.from_numpy(np.require(a, requirements=["W", "C"]))


def _dataset_frame(ds: Any, spec: Any) -> Any:
    """An xarray Dataset's feature variables, those the run trained on, as the columns of a DataFrame.

    Raises
    ------
    TypeError
        The run recorded no feature names (arrays, or a feature variable of several values per sample).
    DataError
        A feature variable is missing, or they are not one value per sample along one shared dimension.
    """
    names = list(spec.feature_names)
    if not names:
        raise TypeError(
            "this run did not train on named features, one column each (arrays, or a feature variable of several "
            "values per sample), so predict cannot pick them from a Dataset; pass the rows as an array, the "
            "features stacked as the run stacked them"
        )
    missing = [n for n in names if n not in ds.data_vars]
    if missing:
        raise DataError(
            f"X lacks the feature variable(s) {missing} the run trained on; it trained on {names} "
            f"(X's variables: {list(ds.data_vars)})"
        )
    dims = {ds[n].dims for n in names}
    if len(dims) != 1 or len(next(iter(dims))) != 1:
        raise DataError(
            f"X's feature variables {names} must hold one value per sample along one shared dimension, as the "
            f"run trained on them; their dimensions: {[ds[n].dims for n in names]}"
        )
    return ds[names].reset_coords(drop=True).to_dataframe()
