"""Pre-flight checks that say what to do: mistakes that would otherwise surface as a raw torch error, a shape
error that hides its cause, NaN updates on the cluster, or a loss that trains on the wrong thing.

:func:`check_run` is called by :func:`vcdask.options.plan_run` before any cluster work.  Each message names
the cause (what vcdask saw) and the remedy (what to change).  :func:`check_model` (the model accepts the data
and the loss its outputs) and :func:`check_target` follow it there.  The model is run once, on a copy, on the CPU,
on a few training rows: that is cheap and tells what its outputs look like against the labels.
:func:`check_model` lives in :mod:`vcdask._forward_check` and is re-exported here.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._forward_check import _CLASS_LOSSES, _N, _shape, check_model, describe_output
from ._stack import user_level
from .device import cpu_copy
from .dtype_kinds import check_input_dtypes, string_labels_error
from .errors import DataError
from .metrics import unwrapped
from .trainable import check_trainable

if TYPE_CHECKING:
    from .prepared import PreparedData

__all__ = [
    "HALF_DTYPES",
    "check_materialized",
    "check_model",
    "check_model_precision",
    "check_nonpersistent_buffers",
    "check_probe_cost",
    "check_run",
    "describe_output",
    "model_dtype",
]

#: Parameter dtypes that train to NaN updates without a gradient scaler: refused, pointing to ``precision=``.
HALF_DTYPES = (torch.float16, torch.bfloat16)

# the built-in losses that compare outputs and labels element by element (and so broadcast mismatched shapes)
_ELEMENTWISE = {"mse": torch.nn.functional.mse_loss, "l1": torch.nn.functional.l1_loss}
# torch's other elementwise loss functions, and the modules of them all (broadcast unless reduction="none")
_ELEMENTWISE_FNS = (*_ELEMENTWISE.values(), torch.nn.functional.huber_loss, torch.nn.functional.smooth_l1_loss)
_ELEMENTWISE_MODULES = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.HuberLoss, torch.nn.SmoothL1Loss)
# (the built-in losses that take class ids, _CLASS_LOSSES, are check_model's: in vcdask._forward_check)


def check_run(model: torch.nn.Module, prepared: PreparedData, *, loss: Any, train_step: Any = None) -> None:
    """Refuse a run that would fail on the cluster, or train on the wrong thing, saying what to do.

    Parameters
    ----------
    model : torch.nn.Module
        The model as given to ``fit`` (it is not changed: the probe runs on a copy).
    prepared : PreparedData
        The training data, as :func:`vcdask.data.prepare_data` describes it.
    loss : str, callable or None
        ``fit``'s ``loss=`` as the user gave it (None: the default for the labels).
    train_step : callable, optional
        With a custom step the labels and outputs are the step's business: only the model is checked.

    Raises
    ------
    ValueError
        A half-precision model (float16 / bfloat16 parameters), one without parameters or with every one frozen
        (:func:`vcdask.trainable.check_trainable`).
    DataError
        String labels; float labels on a classifier with the default loss, or with ``loss="cross_entropy"``
        / ``"nll"``; outputs and labels whose shapes an elementwise loss (``"mse"`` / ``"l1"``, torch's
        ``MSELoss()``, ``L1Loss()``, ``HuberLoss()``, ``SmoothL1Loss()`` or their functions) would broadcast.
        (Outputs that are not one tensor, a tuple or a dict, are refused by :func:`check_model`, which follows.)

    Warns
    -----
    UserWarning
        A non-persistent buffer that a forward pass in train mode changes (:func:`check_nonpersistent_buffers`).
    """
    check_model_precision(model)
    check_trainable(model)  # parameters to train (vcdask.trainable)
    _check_input_dtypes(prepared)
    check_nonpersistent_buffers(model, prepared, train_step=train_step)
    if train_step is not None or prepared.form != "xy" or prepared.sample_y is None:
        return
    y = np.asarray(prepared.sample_y)
    if y.dtype.kind in "USO":
        raise string_labels_error(y)
    check_input_dtypes({"y": y})  # (datetimes, complex numbers: neither class ids nor the model's floats)
    if y.dtype.kind != "f":
        return
    out = _probe(model, prepared.sample_X)
    if out is None:  # the model cannot take the rows: check_model reports it with its own message
        return
    out_shape, y_shape = tuple(out.shape), tuple(y.shape)
    if loss is None and out.dim() > 1 and out.shape[-1] >= 2 and out.numel() != y.size:
        whole = bool(np.all(np.isfinite(y)) and np.all(y == np.round(y)))
        hint = " (these labels look like whole numbers: y.astype('int64') turns them into class ids)" if whole else ""
        raise DataError(
            f"the labels are floats ({y.dtype}), so vcdask trains a regression with MSE, but the model "
            f"outputs {out.shape[-1]} values per sample ({_shape(out_shape)} against labels {_shape(y_shape)}). "
            f"For classification, give integer class ids 0..{out.shape[-1] - 1}{hint}; for regression, pass "
            "loss='mse' with a model whose outputs match the labels' shape (one output per label value)"
        )
    named = _CLASS_LOSSES.get(loss) if isinstance(loss, str) else loss
    if named in _CLASS_LOSSES.values() and out_shape != y_shape:
        name = next(k for k, v in _CLASS_LOSSES.items() if v is named)
        raise DataError(
            f"loss={name!r} compares outputs with class ids, but the labels are floats ({y.dtype}, shape "
            f"{_shape(y_shape)} against outputs {_shape(out_shape)}). Give integer class ids "
            f"(y.astype('int64') when they are whole numbers), or, for a regression, leave loss= unset or pass "
            "loss='mse'"
        )
    shown = _elementwise_name(loss)
    if shown is not None and out_shape != y_shape:
        try:  # the shapes with a symbolic sample count (it broadcasts against the other axes too)
            broadcast = tuple(torch.broadcast_shapes((_N, *out_shape[1:]), (_N, *y_shape[1:])))
        except RuntimeError:
            return  # no broadcast: the loss fails, and check_model reports the shapes
        shapes = (out_shape[1:], y_shape[1:])
        if shapes == ((1,), ()):  # the common case: one output per sample, 1-D labels
            fix = (
                "Give the labels the outputs' shape (y.reshape(-1, 1)), or use a model whose outputs have the "
                "labels' shape (end it with torch.nn.Flatten(0))"
            )
            if "mse" in shown.lower():
                fix += ", or leave loss= unset (the default MSE reshapes (n, 1) outputs to (n,) labels)"
        elif shapes == ((), (1,)):
            fix = "Give the labels the outputs' shape (y.reshape(-1)), or a model with (n, 1) outputs"
        else:
            fix = f"Give labels of the outputs' shape {_shape(out_shape)}, or a model whose outputs match the labels"
        raise DataError(
            f"loss={shown} would compare model outputs of shape {_shape(out_shape)} with labels of shape "
            f"{_shape(y_shape)} by broadcasting them to {_shape(broadcast)}: every output against every label, "
            f"a loss that trains but learns the wrong thing. {fix}"
        )


def _elementwise_name(loss: Any) -> str | None:
    """How ``fit``'s ``loss=`` reads in a message when it compares outputs and labels element by element, and so
    broadcasts shapes that differ (``"'mse'"``, ``"torch.nn.MSELoss()"``, ``"torch.nn.functional.l1_loss"``, also
    in a :func:`functools.partial`); None for another loss, or a module with ``reduction="none"`` (refused by
    :func:`check_model`: not one number for the batch)."""
    if isinstance(loss, str):
        return repr(loss) if loss in _ELEMENTWISE else None
    fn = unwrapped(loss)
    if isinstance(fn, _ELEMENTWISE_MODULES) and getattr(fn, "reduction", "mean") != "none":
        reduction = "" if fn.reduction == "mean" else f"reduction={fn.reduction!r}"
        return f"torch.nn.{type(fn).__name__}({reduction})"
    if any(fn is f for f in _ELEMENTWISE_FNS):
        return f"torch.nn.functional.{fn.__name__}"
    return None


def check_model_precision(model: torch.nn.Module) -> None:
    """Refuse a model with half-precision parameters (``model.half()``), pointing to ``precision=``.

    Half-precision buffers beside float32 parameters (a mask, a float16 table) are taken: a buffer is not
    trained, and a version stores it as it is (merged as an average, which a half dtype holds).

    Raises
    ------
    ValueError
        Naming the parameters, their dtype and the remedy.
    """
    names = [n for n, p in model.named_parameters() if p.dtype in HALF_DTYPES]
    if names:
        half = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.dtype in HALF_DTYPES})
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(
            f"the model holds {'/'.join(half)} parameters ({shown}): trained and merged in half precision, "
            "updates overflow to NaN on the workers (and the workers get excluded). Keep the model in float32 "
            "(model.float()) and pass precision='16-mixed' (float16 autocast with a gradient scaler) or "
            "precision='bf16' (bfloat16 autocast): the parameters stay float32 and the arithmetic runs in half"
        )


def check_nonpersistent_buffers(model: torch.nn.Module, prepared: PreparedData, *, train_step: Any = None) -> None:
    """Warn when a non-persistent buffer (``register_buffer(name, t, persistent=False)``) changes in a forward pass
    in train mode (the default step's ``model(X)``, or ``train_step``, on a few rows, on a copy, on the CPU):
    vcdask merges and returns a model's ``state_dict()``, which leaves such buffers out, so what the workers'
    copies count in them is neither merged nor returned (``result.model`` keeps the values given to ``fit``).

    A buffer the pass replaces with one of another shape or dtype (a cache sized to the inputs) is not said.

    Warns
    -----
    UserWarning
        Naming the buffers that changed and the remedy (register them persistent).
    """
    names = [
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        for name in sorted(module._non_persistent_buffers_set)
        if module._buffers.get(name) is not None
    ]
    if not names:
        return
    from .steps import eval_modules, probe_batch, train_mode

    dtype = model_dtype(model)
    step: Callable[[torch.nn.Module, Any], Any]
    if train_step is not None:
        step, batches = train_step, [probe_batch(prepared, dtype)]
    elif prepared.sample_X is not None:
        X = torch.as_tensor(np.ascontiguousarray(prepared.sample_X))
        step, batches = _forward, [X.to(dtype)] if X.is_floating_point() else [X.to(dtype), X]  # (check_model's)
    else:
        return
    frozen = eval_modules(model)
    for batch in batches:
        probe = train_mode(cpu_copy(model), frozen)
        before = {name: probe.get_buffer(name).clone() for name in names}
        try:
            with torch.no_grad():
                step(probe, batch)
        except Exception:  # noqa: BLE001 - the user's model or step: check_model / check_steps report it
            continue
        changed = []
        for name, was in before.items():
            now = probe.get_buffer(name) if _has_buffer(probe, name) else None
            if now is not None and now.shape == was.shape and now.dtype == was.dtype and not torch.equal(now, was):
                changed.append(name)
        if changed:
            shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
            warnings.warn(
                f"the model's non-persistent buffer{'s' if len(changed) > 1 else ''} {shown} (registered with "
                "persistent=False) changed in a forward pass in train mode, but vcdask merges and returns the "
                "model's state_dict(), which leaves such buffers out: what the workers count in them is neither "
                "merged nor returned (result.model keeps the values given to fit). To keep them, register them "
                "persistent: self.register_buffer(name, tensor) (persistent=True, the default)",
                UserWarning,
                stacklevel=user_level(),  # (fit's caller)
            )
        return


def _forward(model: torch.nn.Module, x: torch.Tensor) -> Any:
    return model(x)


def _has_buffer(model: torch.nn.Module, name: str) -> bool:
    path, _, leaf = name.rpartition(".")
    return model.get_submodule(path)._buffers.get(leaf) is not None


def _check_input_dtypes(prepared: PreparedData) -> None:
    """Inputs that cannot become tensors (strings, objects), or not the model's numbers (datetimes, complex numbers),
    refused by name before torch's own ``can't convert np.ndarray of type numpy.str_`` (or a silent cast)."""
    if prepared.form == "xy" and prepared.sample_X is not None:
        inputs = {"X": np.asarray(prepared.sample_X)}
    elif prepared.form == "dict" and isinstance(prepared.sample, Mapping):
        inputs = {f"[{k!r}]": np.asarray(v) for k, v in prepared.sample.items()}
    else:
        return
    check_input_dtypes(inputs)


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype floating inputs (and float labels) take for ``model``: the floating dtype holding most of its
    parameters' elements (the first such one on a tie), else torch's default dtype.

    A model's layers decide what its inputs must be: a float64 scalar on the root module beside float32 layers
    (a learned temperature, ``self.log_temp``, registered before them, so first in ``parameters()``) does not make
    float64 inputs, nor does an empty float64 parameter.  Recorded as the run's ``RunSpec.x_dtype``: the workers
    cast their batches to it.
    """
    check_materialized(model)
    elements: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            elements[p.dtype] = elements.get(p.dtype, 0) + p.numel()
    if not elements:
        return torch.get_default_dtype()
    return max(elements, key=lambda dtype: elements[dtype])  # (max keeps the first of equals: dicts keep order)


def check_materialized(model: torch.nn.Module) -> None:
    """Refuse a model with lazy parameters not made yet (``torch.nn.LazyLinear`` before its first forward pass),
    saying to run that pass first: vcdask reads the parameters' shapes and dtypes before any data goes through.

    Raises
    ------
    ValueError
        Naming the lazy modules and the remedy.
    """
    lazy = [
        f"{f'module {path!r}' if path else 'the model'} ({type(module).__name__})"
        for path, module in model.named_modules()
        if any(torch.nn.parameter.is_lazy(t) for t in (*module._parameters.values(), *module._buffers.values()))
    ]
    if lazy:
        shown = ", ".join(lazy[:3]) + (f" and {len(lazy) - 3} more" if len(lazy) > 3 else "")
        raise ValueError(
            f"the model has lazy parameters that are not made yet, in {shown}: torch gives them their shapes at the "
            "first forward pass, and vcdask reads the parameters before any data goes through. Run one forward "
            "pass on a few rows first, model(torch.as_tensor(X[:2])), then call fit"
        )


def _probe(model: torch.nn.Module, sample_X: Any) -> torch.Tensor | None:
    """The model's outputs for a few rows, on a copy on the CPU (None when the model cannot take them)."""
    probe = cpu_copy(model).eval()
    X = torch.as_tensor(np.ascontiguousarray(sample_X))
    dtype = model_dtype(probe)
    with torch.no_grad():
        for x in (X.to(dtype),) if X.is_floating_point() else (X.to(dtype), X):
            try:
                out = probe(x)
            except Exception:  # noqa: BLE001 - the user's model; check_model reports what it cannot take
                continue
            return out if isinstance(out, torch.Tensor) else None
    return None


#: :func:`check_probe_cost` warns when a merge's probe would take more than this many seconds here.
PROBE_WARN_SECONDS = 5.0


def check_probe_cost(rule: Any, model: torch.nn.Module, batch: Any, step: Any) -> float | None:
    """Warn when a rule that probes the training loss at every merge (:attr:`MergeRule.needs` has ``"loss"``,
    :class:`vcdask.merge.Probe`) would spend more than :data:`PROBE_WARN_SECONDS` a merge on a CPU.

    ``step(model, batch)`` (the loss) is timed once here, on a CPU copy of the model over ``batch`` (a few
    training rows), and scaled to the rule's rows and its forward passes for a stale update.  Returns that estimate
    in seconds (None for a rule that does not probe).
    """
    if "loss" not in getattr(rule, "needs", ()):
        return None
    probe = cpu_copy(model).eval()
    with torch.no_grad():
        step(probe, batch)  # (a first call pays for lazy set-up)
        t0 = time.perf_counter()
        step(probe, batch)
        seconds = time.perf_counter() - t0
    passes = rule.passes
    estimate = seconds * rule.rows / max(1, _rows(batch)) * passes
    if estimate > PROBE_WARN_SECONDS:
        warnings.warn(
            f"merge={rule.name!r} scores {passes} candidates on {rule.rows} training rows at every merge, on the "
            f"scheduler's CPU: about {estimate:.0f} s a merge for this model (measured here), while the tasks "
            "behind it wait; use fewer rows (vcdask.merge.Probe(rows=...)) or the default merge rule",
            UserWarning,
            stacklevel=user_level(),
        )
    return estimate


def _rows(batch: Any) -> int:
    """The rows in a batch: its first tensor's length (an ``(x, y)`` pair, a dict of columns, a tensor)."""
    while isinstance(batch, (tuple, list, Mapping)) and len(batch):
        batch = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]
    return len(batch) if isinstance(batch, torch.Tensor) and batch.ndim else 1
