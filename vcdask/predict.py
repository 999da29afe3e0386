"""Using a trained model: :meth:`FitResult.predict` and :meth:`FitResult.predict_proba`.

The rows go through the model in batches, without gradients, in eval mode, on one device; inputs are
read the way the run read its training data (a DataFrame's feature columns, or an xarray Dataset's feature
variables, selected by the names the run recorded, as float32; arrays cast to the model's dtype unless the
run kept integer inputs), and the outputs come back as numpy.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from .device import check_device, cpu_copy, resolve_device, same_device
from .errors import DataError
from .preflight import describe_output

__all__ = ["model_outputs"]


def model_outputs(
    model: torch.nn.Module, spec: Any, X: Any, *, batch_size: int = 1024, device: Any = None
) -> torch.Tensor:
    """The model's outputs for the rows of ``X``, on the CPU (one forward pass per ``batch_size`` rows).

    Parameters
    ----------
    model : torch.nn.Module
        The trained model (left in the mode and on the device it was: another device gets a copy).
    spec : RunSpec
        The run's spec: its batch form, feature columns, input dtype.
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
    x = cast_like_training(x, spec)
    was_training = net.training
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
                outs.append(out.detach().cpu())
    finally:
        net.train(was_training)
    if not outs:
        raise DataError("X is empty (0 rows)")
    return torch.cat(outs)


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
