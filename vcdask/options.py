"""Options of a run: the loss, metric and optimizer resolvers, and :func:`plan`, the one planning path of
``fit`` and ``vcdask train``: it checks every argument before any cluster work (each error names the bad value
and the valid choices) and gives a typed :class:`RunPlan`.

The option groups themselves (:class:`~vcdask.Merging`, :class:`~vcdask.Training`, :class:`~vcdask.Stopping`)
check their own values (:mod:`vcdask.groups`); :func:`plan` checks what needs the model and the data.
:func:`vcdask.resume` plans nothing: it continues a run from its saved spec, and its one option,
``max_epochs``, is checked as ``fit``'s is (:func:`~vcdask._ints.positive_int`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import config
from ._computing import DataComputing
from ._data_options import check_storage_options
from ._ints import check_bool, is_real, positive_int
from ._pickle_check import check_picklable
from ._plan_checks import check_groups, check_label_kind, check_same_form, check_step_options
from ._targets import check_direction, check_target
from .cluster import check_client
from .cost import check_prices
from .data import DataError, PreparedData, prepare_data
from .device import loss_to
from .finite import check_finite
from .groups import Merging, Stopping, Training
from .holdout import check_early_stopping, hold_out
from .merge import Auto, MergeRule, get_rule
from .metrics import check_accuracy, check_metric_names, class_axis, class_ids, metric_name, one_logit, unwrapped
from .optimizers import check_inner_optimizer, resolve_optimizer
from .overlap import check_overlap
from .preflight import HALF_DTYPES, check_model, check_probe_cost, check_run, model_dtype
from .resilience import NEEDS_VALIDATION, Resilience
from .staging import split
from .steps import SupervisedStep, check_steps, probe_batch
from .store import ParamStore, Retention, open_store
from .store._retention import check_retention
from .trainable import check_trainable
from .variables import stored_order, training_features

logger = logging.getLogger(__name__)

#: Where runs go when ``fit`` is given no store: a local directory.
DEFAULT_STORE = "vcdask-runs"

__all__ = [
    "DEFAULT_STORE",
    "LOSSES",
    "METRICS",
    "RunPlan",
    "accuracy",
    "binary_classifier",
    "mae",
    "mse",
    "plan",
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
    """Fraction of labels the outputs predict (:func:`vcdask.metrics.class_ids`): the arg-max of the scores per
    class (along axis 1 of a classifier per position's, as cross_entropy reads them), or one logit per label,
    class 1 where it is above 0."""
    return float((class_ids(output, target.shape) == target).float().mean()) if len(target) else float("nan")


def mae(output: torch.Tensor, target: torch.Tensor, *, logits: bool = False) -> float:
    """Mean absolute error; of a classifier, that of its predicted class ids (ordered classes: ratings).
    ``logits``: the outputs are one logit per label of a binary classifier (see :func:`resolve_metrics`)."""
    return float(torch.nn.functional.l1_loss(*_predicted(output, target, logits)))


def mse(output: torch.Tensor, target: torch.Tensor, *, logits: bool = False) -> float:
    """Mean squared error; of a classifier, that of its predicted class ids (ordered classes: ratings).
    ``logits``: the outputs are one logit per label of a binary classifier (see :func:`resolve_metrics`)."""
    return float(torch.nn.functional.mse_loss(*_predicted(output, target, logits)))


def _predicted(output: torch.Tensor, target: torch.Tensor, logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What an error metric compares: a classifier's class ids (its scores per class, integer labels; one logit
    per float 0/1 label, ``logits``: :func:`vcdask.metrics.class_ids`) as numbers, or a regression's outputs in
    the labels' shape."""
    if logits or (not target.is_floating_point() and class_axis(output.shape, target.shape) is not None):
        return class_ids(output, target.shape).float(), target.float()
    return output.reshape(target.shape), target


METRICS: dict[str, Callable] = {"accuracy": accuracy, "mae": mae, "mse": mse}


def resolve_loss(loss, classification: bool) -> Callable:
    if loss is None:
        return LOSSES["cross_entropy"] if classification else _mse_matching
    if isinstance(loss, str):
        try:
            return LOSSES[loss]
        except KeyError:
            raise ValueError(f"unknown loss {loss!r}; available: {sorted(LOSSES)} (or a callable)") from None
    if isinstance(loss, type) and issubclass(loss, torch.nn.Module):  # (called, it would make a loss of the outputs)
        where = "torch.nn" if loss.__module__.startswith("torch.nn.") else loss.__module__
        name = f"{where}.{loss.__qualname__}"
        raise TypeError(f"loss={name} is a class: pass an instance, loss={name}() (or a name from {sorted(LOSSES)})")
    if isinstance(loss, (torch.nn.Module, functools.partial)):  # (its tensors on the CPU, as the run's model's:
        return loss_to(loss, torch.device("cpu"))  # the checks compute there; the workers copy them to their device)
    if callable(loss):
        return loss
    raise TypeError(f"loss must be a name from {sorted(LOSSES)} or a callable, got {type(loss).__name__}")


def _mse_matching(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE that accepts (n, 1) outputs for (n,) targets."""
    return torch.nn.functional.mse_loss(output.reshape(target.shape), target)


def resolve_metrics(metrics, classification: bool, binary: bool = False) -> dict[str, Callable]:
    """``metrics=`` as ``{name: fn(output, target) -> float}`` (names from :data:`METRICS`, callables named by
    :func:`vcdask.metrics.metric_name`, or a dict); raises ValueError for an unknown name or names that collide
    (:func:`vcdask.metrics.check_metric_names`), TypeError for a value that is not a callable.

    ``binary``: a binary classifier of one logit per float 0/1 label (:func:`binary_classifier`): a classifier's
    default, ``accuracy``, and :func:`mae` / :func:`mse` of its class ids (class 1 where the logit is above 0),
    as ``accuracy`` and :meth:`FitResult.predict <vcdask.FitResult.predict>` read them, not of its logits.
    """
    if metrics is None:
        return {"accuracy": accuracy} if classification or binary else {"mae": mae}
    if isinstance(metrics, str):
        metrics = [metrics]
    if isinstance(metrics, Mapping):
        bad = [k for k, v in metrics.items() if not callable(v)]
        if bad:
            raise TypeError(f"metrics {bad} are not callables (output, target) -> float")
        named = list(zip(check_metric_names(metrics), metrics.values(), strict=True))
    else:
        named = []
        for m in metrics:
            if callable(m):
                named.append((metric_name(m), m))  # (a partial: "topk(k=3)")
            elif m in METRICS:
                named.append((m, METRICS[m]))
            else:
                raise ValueError(f"unknown metric {m!r}; available: {sorted(METRICS)} (or a callable)")
        check_metric_names(n for n, _ in named)
    # (vcdask's own mae and mse of a binary classifier: of its class ids)
    return {name: functools.partial(fn, logits=True) if binary and fn in (mae, mse) else fn for name, fn in named}


def binary_classifier(prepared: PreparedData, loss: Callable) -> bool:
    """Whether a run of the default step on ``prepared`` with ``loss`` is a binary classifier of one logit per
    label: float labels and a loss of :func:`vcdask.metrics.one_logit` (as
    :func:`vcdask.predict.binary_classifier` reads the run's spec)."""
    return not prepared.classification and one_logit(loss)


@dataclass(frozen=True)
class RunPlan:
    """A run's inputs, checked and coerced (before any cluster work): what :func:`vcdask.runs.launch` turns
    into the run's :class:`~vcdask.spec.RunSpec`."""

    model: torch.nn.Module
    train: PreparedData
    validation: PreparedData | None
    store: ParamStore
    rule: MergeRule  # merging.rule for this data (MergeRule.for_run with the samples of an epoch)
    loss: Callable
    optimizer: Callable  # params -> torch.optim.Optimizer (training.optimizer and training.lr)
    metrics: dict[str, Callable]  # the default step's metrics ({} with a train_step)
    x_dtype: torch.dtype
    cast_x: bool  # (X, y) data: X takes the model's dtype
    n_shards: int | None  # None: Shards.default, from the cluster's threads when the run starts
    max_epochs: int
    seed: int
    keep_updates: bool
    merging: Merging
    training: Training
    stopping: Stopping  # target checked against the run's metrics; monitor decided (None: not validated)
    resilience: Resilience
    retention: Retention | None  # None: keep every version
    train_step: Callable | None
    eval_step: Callable | None
    metric_names: tuple[str, ...]  # what validation reports: "loss" first, then the metrics
    step_metrics: tuple[str, ...]  # eval_step's names (RunSpec.metric_names); () with the default step
    prices: dict[str, dict[str, float]]  # vcdask.cost, from vcdask.cloud.prices
    overlap: str  # vcdask.overlap, from vcdask.worker.overlap
    # the Client plan opened for client= given as a cluster or an address, to compute its checks of dask data on
    # that cluster (DataComputing): the run's, which runs.launch runs it on and closes; None when none was opened
    client: Any = None


def plan(
    model: Any,
    data: Any,
    *,
    merging: Merging | None = None,
    training: Training | None = None,
    stopping: Stopping | None = None,
    resilience: Resilience | None = None,
    retention: Retention | bool | None = None,
    loss: str | Callable | None = None,
    metrics: Any = None,
    train_step: Callable | None = None,
    eval_step: Callable | None = None,
    collate_fn: Callable | None = None,
    validation: Any = None,
    max_epochs: int = 10,
    n_shards: int | None = None,
    client: Any = None,
    store: Any = None,
    seed: int = 0,
    features: Any = None,
    label: str | None = None,
    sample_dim: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    shuffle: bool = True,
    keep_updates: bool = False,
) -> RunPlan:
    """Check every option of :func:`vcdask.fit` and prepare the data; raise before any cluster work.

    The groups come checked (:func:`vcdask.groups.fold` makes them from ``fit``'s flat arguments); here
    the rest, and what needs the model and the data.  The one place that decides the validation a run gets
    (:func:`vcdask.holdout.hold_out`), the metrics it reports (:attr:`RunPlan.metric_names`) and its early
    stopping, for ``fit`` and ``vcdask train`` alike.  The keywords are ``fit``'s, with its defaults.

    Dask data (and Zarr data, scanned through dask) is computed on the cluster of ``client``
    (:class:`~vcdask._computing.DataComputing`): a cluster object or an address is connected to once, at the
    first computation, and that Client comes back
    as :attr:`RunPlan.client` (the run's: :func:`vcdask.runs.launch` runs on it and closes it; a caller that
    does not launch the plan closes it).

    Returns
    -------
    RunPlan

    Raises
    ------
    ValueError, TypeError
        A bad option; the message names the value and the valid choices.
    DataError
        Data that cannot be trained on as given (the message says why and what to do).
    """
    merging = Merging() if merging is None else merging
    training = Training() if training is None else training
    stopping = Stopping() if stopping is None else stopping
    resilience = Resilience() if resilience is None else resilience
    check_groups(merging=merging, training=training, stopping=stopping, resilience=resilience)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    given = {"loss": loss, "metrics": metrics, "train_step": train_step, "eval_step": eval_step}
    given.update(collate_fn=collate_fn, optimizer=training.optimizer, lr_schedule=training.lr_schedule)
    given.update(merge=merging.rule, alpha=merging.alpha, resilience=resilience, retention=retention)
    check_trainable(model)  # (its own refusals first: a parametrized module does not pickle, with its remedy)
    check_picklable(model, given)  # (the run's spec carries them, pickled once the cluster is up)
    check_client(client)
    overlap = check_overlap(config.get("worker.overlap"))
    if overlap == "delta" and resilience.rejects_updates:
        # each update is screened against the version it trained from: with "delta" a task's first steps
        # would be taken from its worker's last W_c, which the screen may have rejected (a sign-flipping
        # worker's update then looked orthogonal to the server's own step, not opposite, and passed)
        overlap = "wait"
    max_epochs = positive_int("max_epochs", max_epochs)
    seed = positive_int("seed", seed, minimum=0)  # (numpy's generators take no negative seed)
    shuffle, keep_updates = check_bool("shuffle", shuffle), check_bool("keep_updates", keep_updates)
    checked_retention = check_retention(retention)  # None: the default policy; False: keep every version (None)
    check_step_options(train_step, eval_step, loss, metrics)
    validation = hold_out(validation, target=stopping.target, patience=stopping.patience, monitor=stopping.monitor)
    if validation is not None and is_real(validation):
        if not 0.0 < float(validation) < 1.0:
            raise ValueError(f"validation as a fraction must be in (0, 1), got {validation!r}")
        validation = float(validation)
    n_shards = None if n_shards is None else positive_int("n_shards", n_shards)
    prices = check_prices(config.get("cloud.prices"))

    # what needs the data, computed on the cluster of client= for dask data: from here on, a Client it connected
    computing = DataComputing(client)
    with contextlib.ExitStack() as undo:
        undo.callback(computing.close)  # (a refusal after it connected closes the Client it opened)
        names = {"features": features, "label": label, "sample_dim": sample_dim, "storage_options": storage_options}
        names.update(batches="dict" if train_step is not None else "xy", collate_fn=collate_fn)
        names.update(scheduler=computing.scheduler)
        check_storage_options(data, storage_options, validation)  # (what the validation data reads with them too)
        prepared = prepare_data(data, **names)
        x_dtype = model_dtype(model)
        cast_to = None if x_dtype in HALF_DTYPES else x_dtype  # (a half-precision model: check_run says what to do)
        # NaN / inf (or inf once cast), named, before a NaN update blames a worker
        check_finite(prepared, dtype=cast_to, scheduler=computing.scheduler)
        if train_step is None and prepared.form == "dict":
            raise TypeError(
                "dict data gives dict batches, which the default step (loss(model(X), y)) cannot train on; "
                "pass train_step=fn(model, batch) -> loss (and eval_step=fn(model, batch) -> dict of metrics)"
            )
        check_run(model, prepared, loss=loss, train_step=train_step)  # causes and remedies, before the probes below
        if train_step is None:
            loss_fn = resolve_loss(loss, prepared.classification)
            metric_fns = resolve_metrics(metrics, prepared.classification, binary_classifier(prepared, loss_fn))
            ours = [n for n, fn in metric_fns.items() if any(unwrapped(fn) is f for f in METRICS.values())]
            cast_x = check_model(
                model, prepared, loss_fn, prepared.classification, x_dtype, metrics=metric_fns, strict=ours
            )
            metric_names = ("loss", *metric_fns)
            check_accuracy([n for n, fn in metric_fns.items() if fn is accuracy], loss_fn, prepared.classification)
        else:
            loss_fn, metric_fns, cast_x = resolve_loss(loss, prepared.classification), {}, False
            sample = probe_batch(prepared, x_dtype)
            metric_names = tuple(check_steps(model, sample, train_step, eval_step, (prepared, x_dtype)))
        target = check_target(stopping.target, [m for m in metric_names if m != "loss"], metric_fns)
        screens = [n for n in NEEDS_VALIDATION if getattr(resilience, n) is not None]
        if screens and validation is None:
            raise ValueError(
                f"Resilience({screens[0]}=...) screens updates on a probe of the validation set; "
                "pass validation= (data, or a fraction of the training data to hold out)"
            )
        val_prepared = None
        if validation is not None and not isinstance(validation, float):
            # a DataFrame's columns, an xarray / Zarr dataset's variables: training's, by name, in training's order
            named = training_features(data, prepared, features, label)
            if named:
                names["features"] = list(named)
            val_prepared = prepare_data(validation, **names, what="validation")
            check_finite(val_prepared, "validation", dtype=cast_to, scheduler=computing.scheduler)
            check_same_form(prepared, val_prepared)
            if prepared.form != "dataset" and val_prepared.shapes != prepared.shapes:
                shapes = f"validation samples have shapes {val_prepared.shapes}, training samples {prepared.shapes}"
                raise DataError(shapes)
            if train_step is None:  # its labels fit too: of the training's kind (cast like them), in range
                check_label_kind(prepared, val_prepared)
                check_model(model, val_prepared, loss_fn, prepared.classification, x_dtype, what="validation")
        prepared, split_val = split(prepared, validation, seed, shuffle and not stored_order(data))
        if n_shards is not None and n_shards > prepared.n:
            raise ValueError(
                f"n_shards={n_shards} is more than the {prepared.n} training samples; "
                f"choose 1 <= n_shards <= {prepared.n}"
            )
        rule = get_rule(merging.rule, merging.alpha, samples_per_epoch=prepared.n)
        if "loss" in rule.needs and not isinstance(rule, Auto):  # a probe at every merge, on the scheduler: its cost
            check_probe_cost(rule, model, probe_batch(prepared, x_dtype), train_step or SupervisedStep(loss_fn))
        optimizer_fn = resolve_optimizer(training.optimizer, training.lr)
        check_inner_optimizer(  # as the workers build it
            optimizer_fn, model, given=training.optimizer, lr=training.lr, clip_grad_norm=training.clip_grad_norm
        )
        param_store = open_store(DEFAULT_STORE if store is None else store)  # last: it may create a directory
        if not param_store.shared_across_processes and client is None:
            raise ValueError(
                f"store {param_store.location!r} lives in this process only, but the embedded cluster "
                "runs worker processes; use a directory or object-store location, or pass a client "
                "whose workers run in this process (LocalCluster(processes=False))"
            )
        reported = tuple(dict.fromkeys(("loss", *metric_names)))
        validated = val_prepared or split_val
        patience, monitor = check_early_stopping(
            stopping.patience, stopping.monitor, target, reported, validated is not None
        )
        if monitor is not None and monitor not in (target or {}) and (stopping.monitor or patience):
            check_direction(monitor, f"monitor={monitor!r} (early stopping and best_version) keeps its highest value")
        planned = RunPlan(
            model=model,
            train=prepared,
            validation=validated,
            store=param_store,
            rule=rule,
            loss=loss_fn,
            optimizer=optimizer_fn,
            metrics=metric_fns,
            x_dtype=x_dtype,
            cast_x=cast_x,
            n_shards=n_shards,
            max_epochs=max_epochs,
            seed=seed,
            keep_updates=keep_updates,
            merging=merging,
            training=training,
            stopping=replace(stopping, target=target, patience=patience, monitor=monitor),
            resilience=resilience,
            retention=checked_retention,
            train_step=train_step,
            eval_step=eval_step,
            metric_names=reported,
            step_metrics=metric_names if train_step is not None else (),
            prices=prices,
            overlap=overlap,
            client=computing.opened,
        )
        undo.pop_all()  # (the Client opened is the run's now: runs.launch closes it)
        return planned
