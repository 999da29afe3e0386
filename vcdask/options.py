"""Options of a run: the loss, metric and optimizer resolvers, and :func:`plan_run`, the checks ``fit`` runs
on its arguments before any cluster work (each error names the bad value and the valid choices)."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import config
from ._ints import positive_int
from .cluster import check_client
from .compress import check_compression
from .cost import check_prices
from .data import DataError, PreparedData, prepare_data
from .device import check_device, check_precision
from .finite import check_finite
from .holdout import check_early_stopping, hold_out
from .inner import check_optimizer_state, check_schedule
from .merge import MergeRule, get_rule
from .overlap import check_overlap
from .preflight import check_model, check_run, check_target, model_dtype
from .resilience import NEEDS_VALIDATION, Resilience
from .staging import split
from .steps import check_steps, probe_batch
from .store import ParamStore, open_store
from .store._retention import check_retention

logger = logging.getLogger(__name__)

#: Where runs go when ``fit`` is given no store: a local directory.
DEFAULT_STORE = "vcdask-runs"

__all__ = [
    "LOSSES",
    "METRICS",
    "accuracy",
    "check_model",
    "check_target",
    "mae",
    "model_dtype",
    "mse",
    "positive_int",
    "resolve_loss",
    "resolve_metrics",
    "resolve_optimizer",
]

LOSSES: dict[str, Callable] = {
    "cross_entropy": torch.nn.functional.cross_entropy,
    "mse": torch.nn.functional.mse_loss,
    "l1": torch.nn.functional.l1_loss,
    "nll": torch.nn.functional.nll_loss,
}


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    """Fraction of samples whose arg-max output equals the label."""
    return float((output.argmax(dim=-1) == target).float().mean()) if len(target) else float("nan")


def mae(output: torch.Tensor, target: torch.Tensor) -> float:
    """Mean absolute error."""
    return float(torch.nn.functional.l1_loss(output.reshape(target.shape), target))


def mse(output: torch.Tensor, target: torch.Tensor) -> float:
    """Mean squared error."""
    return float(torch.nn.functional.mse_loss(output.reshape(target.shape), target))


METRICS: dict[str, Callable] = {"accuracy": accuracy, "mae": mae, "mse": mse}


def resolve_loss(loss, classification: bool) -> Callable:
    if loss is None:
        return LOSSES["cross_entropy"] if classification else _mse_matching
    if isinstance(loss, str):
        try:
            return LOSSES[loss]
        except KeyError:
            raise ValueError(f"unknown loss {loss!r}; available: {sorted(LOSSES)} (or a callable)") from None
    if callable(loss):
        return loss
    raise TypeError(f"loss must be a name from {sorted(LOSSES)} or a callable, got {type(loss).__name__}")


def _mse_matching(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE that accepts (n, 1) outputs for (n,) targets."""
    return torch.nn.functional.mse_loss(output.reshape(target.shape), target)


def resolve_metrics(metrics, classification: bool) -> dict[str, Callable]:
    if metrics is None:
        return {"accuracy": accuracy} if classification else {"mae": mae}
    if isinstance(metrics, str):
        metrics = [metrics]
    if isinstance(metrics, Mapping):
        bad = [k for k, v in metrics.items() if not callable(v)]
        if bad:
            raise TypeError(f"metrics {bad} are not callables (output, target) -> float")
        return dict(metrics)
    out = {}
    for m in metrics:
        if callable(m):
            out[getattr(m, "__name__", repr(m))] = m
        elif m in METRICS:
            out[m] = METRICS[m]
        else:
            raise ValueError(f"unknown metric {m!r}; available: {sorted(METRICS)} (or a callable)")
    return out


def resolve_optimizer(optimizer, lr: float) -> Callable:
    if optimizer is None:
        return functools.partial(torch.optim.Adam, lr=lr)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return functools.partial(optimizer, lr=lr)  # type: ignore[call-arg]  # every torch optimizer takes lr
    if callable(optimizer):
        return optimizer
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer class or a callable params -> optimizer, "
        f"got {type(optimizer).__name__}"
    )


@dataclass(frozen=True)
class RunPlan:
    """A run's inputs, checked and coerced (before any cluster work)."""

    model: torch.nn.Module
    train: PreparedData
    validation: PreparedData | None
    store: ParamStore
    rule: MergeRule
    loss: Callable
    optimizer: Callable
    metrics: dict[str, Callable]
    target: dict[str, float] | None
    x_dtype: torch.dtype
    n_shards: int | None  # None: Shards.default, from the cluster's threads when the run starts
    options: dict[str, Any]  # the remaining RunSpec fields
    metric_names: tuple[str, ...] = ("loss",)  # what validation reports: "loss" first, then the metrics
    patience: int | None = None  # early stopping, checked (vcdask.holdout.check_early_stopping)
    monitor: str | None = None  # the metric it (and FitResult.best_version) follows; None: not validated


def plan_run(
    model,
    data,
    *,
    loss,
    optimizer,
    lr,
    max_epochs,
    n_shards,
    local_epochs,
    batch_size,
    merge,
    alpha,
    target,
    validation,
    metrics,
    client,
    store,
    seed,
    commit_every,
    validate_every,
    features,
    label,
    sample_dim,
    storage_options,
    shuffle,
    keep_updates,
    tasks_per_slot,
    resilience,
    train_step=None,
    eval_step=None,
    collate_fn=None,
    device="auto",
    precision="32",
    optimizer_state="auto",
    lr_schedule=None,
    clip_grad_norm=None,
    retention=None,
    compression=None,
    speed_adaptive=False,
    patience=None,
    monitor=None,
) -> RunPlan:
    """Check every argument of :func:`fit` and prepare the data; raise before any cluster work.

    The one place that decides the validation a run gets (:func:`vcdask.holdout.hold_out`), the metrics
    it reports (:attr:`RunPlan.metric_names`) and its early stopping (``patience``, ``monitor``), for
    ``fit`` and ``vcdask train`` alike."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_client(client)
    get_rule(merge, alpha)  # a bad rule name fails before the data is read
    overlap = check_overlap(config.get("worker.overlap"))
    ints: dict[str, int | str] = {
        name: positive_int(name, value)
        for name, value in (
            ("max_epochs", max_epochs),
            ("local_epochs", local_epochs),
            ("batch_size", batch_size),
            ("tasks_per_slot", tasks_per_slot),
        )
    }
    ints["validate_every"] = (
        "auto" if validate_every == "auto" else positive_int("validate_every", validate_every, also="'auto'")
    )
    # "auto": every merge, except that results queued together share a commit
    ints["commit_every"] = (
        "auto" if commit_every == "auto" else positive_int("commit_every", commit_every, also="'auto'")
    )
    retention = check_retention(retention)  # None: the default policy; False: keep every version (None)
    compression = check_compression(compression)
    if not isinstance(speed_adaptive, bool):  # (a truthy string would silently switch it on)
        raise TypeError(f"speed_adaptive must be True or False, got {speed_adaptive!r}")
    if resilience is None:
        resilience = Resilience()
    elif not isinstance(resilience, Resilience):
        raise TypeError(f"resilience must be a vcdask.Resilience, got {type(resilience).__name__}")
    if not isinstance(lr, (int, float)) or not lr > 0 or math.isinf(lr):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    training = _check_training(
        train_step, eval_step, loss, metrics, device, precision, optimizer_state, lr_schedule, clip_grad_norm
    )
    validation = hold_out(validation, target=target, patience=patience, monitor=monitor)
    if validation is not None and isinstance(validation, (int, float)) and not isinstance(validation, bool):
        if not 0.0 < float(validation) < 1.0:
            raise ValueError(f"validation as a fraction must be in (0, 1), got {validation!r}")
        validation = float(validation)

    names = {"features": features, "label": label, "sample_dim": sample_dim, "storage_options": storage_options}
    names.update(batches="dict" if train_step is not None else "xy", collate_fn=collate_fn)
    prepared = prepare_data(data, **names)
    check_finite(prepared)  # NaN / inf in the data, named, before a NaN update blames a worker
    if train_step is None and prepared.form == "dict":
        raise TypeError(
            "dict data gives dict batches, which the default step (loss(model(X), y)) cannot train on; "
            "pass train_step=fn(model, batch) -> loss (and eval_step=fn(model, batch) -> dict of metrics)"
        )
    x_dtype = model_dtype(model)
    check_run(model, prepared, loss=loss, train_step=train_step)  # causes and remedies, before the probes below
    if train_step is None:
        loss_fn = resolve_loss(loss, prepared.classification)
        metric_fns = resolve_metrics(metrics, prepared.classification)
        cast_x = check_model(model, prepared, loss_fn, prepared.classification, x_dtype)
        metric_names = ("loss", *metric_fns)
    else:
        loss_fn, metric_fns, cast_x = resolve_loss(loss, prepared.classification), {}, False
        metric_names = tuple(check_steps(model, probe_batch(prepared, x_dtype), train_step, eval_step))
    target = check_target(target, [m for m in metric_names if m != "loss"])
    screens = [n for n in NEEDS_VALIDATION if getattr(resilience, n) is not None]
    if screens and validation is None:
        raise ValueError(
            f"Resilience({screens[0]}=...) screens updates on a probe of the validation set; "
            "pass validation= (data, or a fraction of the training data to hold out)"
        )
    val_prepared = None
    if validation is not None and not isinstance(validation, float):
        if prepared.feature_names:  # a DataFrame: the training columns, by name, whatever the order
            names["features"] = list(prepared.feature_names)
        val_prepared = prepare_data(validation, **names, what="validation")
        check_finite(val_prepared, "validation")
        if val_prepared.form != prepared.form or (
            prepared.form != "dataset" and val_prepared.shapes != prepared.shapes
        ):
            raise DataError(f"validation samples have shapes {val_prepared.shapes}, training samples {prepared.shapes}")
    prepared, split_val = split(prepared, validation, seed, shuffle)
    n_shards = None if n_shards is None else positive_int("n_shards", n_shards)
    if n_shards is not None and n_shards > prepared.n:
        raise ValueError(
            f"n_shards={n_shards} is more than the {prepared.n} training samples; choose 1 <= n_shards <= {prepared.n}"
        )
    rule = get_rule(merge, alpha, samples_per_epoch=prepared.n)
    optimizer_fn = resolve_optimizer(optimizer, lr)
    param_store = open_store(DEFAULT_STORE if store is None else store)  # last: it may create a directory
    if not param_store.shared_across_processes and client is None:
        raise ValueError(
            f"store {param_store.location!r} lives in this process only, but the embedded cluster "
            "runs worker processes; use a directory or object-store location, or pass a client "
            "whose workers run in this process (LocalCluster(processes=False))"
        )
    reported = tuple(dict.fromkeys(("loss", *metric_names)))
    validated = val_prepared or split_val
    patience, monitor = check_early_stopping(patience, monitor, target, reported, validated is not None)
    return RunPlan(
        model=model,
        train=prepared,
        validation=validated,
        store=param_store,
        rule=rule,
        loss=loss_fn,
        optimizer=optimizer_fn,
        metrics=metric_fns,
        target=target,
        x_dtype=x_dtype,
        n_shards=n_shards,
        options={
            **ints,
            "seed": seed,
            "keep_updates": keep_updates,
            "resilience": resilience,
            "retention": retention,
            "compression": compression,
            "speed_adaptive": speed_adaptive,
            "prices": check_prices(config.get("cloud.prices")),
            "overlap": overlap,
            **training,
            "metric_names": metric_names if train_step is not None else (),
            "batch_form": prepared.form,
            "feature_names": prepared.feature_names,
            "cast_x": cast_x,
        },
        metric_names=reported,
        patience=patience,
        monitor=monitor,
    )


def _check_training(
    train_step, eval_step, loss, metrics, device, precision, optimizer_state, lr_schedule, clip_grad_norm
) -> dict[str, Any]:
    """The options of local training, checked: the RunSpec fields they become."""
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
    if clip_grad_norm is not None and (
        isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)) or not clip_grad_norm > 0
    ):
        raise ValueError(f"clip_grad_norm must be a positive number or None, got {clip_grad_norm!r}")
    return {
        "train_step": train_step,
        "eval_step": eval_step,
        "device": check_device(device),
        "precision": check_precision(precision),
        "optimizer_state": check_optimizer_state(optimizer_state),
        "lr_schedule": check_schedule(lr_schedule),
        "clip_grad_norm": None if clip_grad_norm is None else float(clip_grad_norm),
    }
