"""``vcdask.fit``: check and coerce the inputs, then hand a run to the scheduler plugin."""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import pickle
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from .cluster import check_client, resolve_client
from .data import DataError, PreparedData, Shards, prepare_data, stage
from .handle import FitResult, RunHandle, ensure_plugin
from .resilience import Resilience
from .rules import DEFAULT_RULE, Nesterov, get_rule
from .store import ParamStore, open_store
from .task import RunSpec

logger = logging.getLogger(__name__)

__all__ = ["fit", "resume"]

DEFAULT_STORE = "vcdask-runs"


# -- options ---------------------------------------------------------------------------------
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


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _resolve_loss(loss, classification: bool) -> Callable:
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


def _resolve_metrics(metrics, classification: bool) -> dict[str, Callable]:
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


def _resolve_optimizer(optimizer, lr: float) -> Callable:
    if optimizer is None:
        return functools.partial(torch.optim.Adam, lr=lr)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return functools.partial(optimizer, lr=lr)
    if callable(optimizer):
        return optimizer
    raise TypeError(f"optimizer must be a torch.optim.Optimizer class or a callable params -> optimizer, "
                    f"got {type(optimizer).__name__}")


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _check_model(model, prepared: PreparedData, loss, classification: bool, x_dtype) -> None:
    """One forward pass on a few rows: the model accepts the data and its outputs fit the labels."""
    probe = copy.deepcopy(model).eval()
    X = torch.as_tensor(np.ascontiguousarray(prepared.sample_X)).to(x_dtype)
    try:
        with torch.no_grad():
            out = probe(X)
    except Exception as e:  # noqa: BLE001 - any failure here is a model/data mismatch to report
        raise DataError(f"the model cannot process the training data: samples of shape {tuple(prepared.x_shape)} "
                        f"and dtype {prepared.x_dtype} -> {type(e).__name__}: {e}") from e
    if classification:
        n_classes = out.shape[-1] if out.dim() > 1 else 1
        if prepared.y_min < 0 or prepared.y_max >= n_classes:
            raise DataError(f"labels range over [{prepared.y_min}, {prepared.y_max}] but the model outputs "
                            f"{n_classes} classes; labels must be in [0, {n_classes - 1}]")
    y = torch.as_tensor(np.ascontiguousarray(prepared.sample_y))
    y = y.long() if classification else y.to(x_dtype)
    try:
        loss(out, y)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"the loss cannot compare model outputs of shape {tuple(out.shape)} with labels of "
                        f"shape {tuple(y.shape)}: {type(e).__name__}: {e}") from e


def _check_target(target, metric_names) -> dict[str, float] | None:
    if target is None:
        return None
    if not isinstance(target, Mapping) or not target:
        raise TypeError(f"target must be a mapping like {{'accuracy': 0.95}}, got {target!r}")
    valid = ["loss", *metric_names]
    for name, goal in target.items():
        if name not in valid:
            raise ValueError(f"target metric {name!r} is not computed; available: {valid}")
        if not isinstance(goal, (int, float)) or math.isnan(goal):
            raise ValueError(f"target value for {name!r} must be a number, got {goal!r}")
    return {k: float(v) for k, v in target.items()}


def _split(prepared: PreparedData, validation, seed: int, shuffle: bool):
    """Shuffle in-memory data once (seeded) and split off a validation fraction."""
    rng = np.random.default_rng(seed)
    if prepared.source is None and shuffle and isinstance(prepared.X, np.ndarray):
        order = rng.permutation(prepared.n)
        prepared.X, prepared.y = prepared.X[order], prepared.y[order]
    if not isinstance(validation, float):
        return prepared, None
    n_val = max(1, int(round(prepared.n * validation)))
    if n_val >= prepared.n:
        raise ValueError(f"validation={validation} leaves no training samples out of {prepared.n}")
    n_train = prepared.n - n_val
    if prepared.source is not None:
        train = copy.copy(prepared)
        train.source, train.n = prepared.source.slice(0, n_train), n_train
        val = copy.copy(prepared)
        val.source, val.n = prepared.source.slice(n_train, prepared.n), n_val
        return train, val
    train, val = copy.copy(prepared), copy.copy(prepared)
    train.X, train.y, train.n = prepared.X[:n_train], prepared.y[:n_train], n_train
    val.X, val.y, val.n = prepared.X[n_train:], prepared.y[n_train:], n_val
    return train, val


# -- fit ---------------------------------------------------------------------------------
def fit(
    model: torch.nn.Module,
    data: Any,
    *,
    loss: str | Callable | None = None,
    optimizer: Any = None,
    lr: float = 1e-3,
    max_epochs: int = 10,
    n_shards: int | None = None,
    local_epochs: int = 1,
    batch_size: int = 32,
    merge: str | Any = None,
    alpha: float | str | Callable[[int], float] | None = None,
    target: Mapping[str, float] | None = None,
    validation: Any = None,
    metrics: Sequence[str | Callable] | Mapping[str, Callable] | None = None,
    client: Any = None,
    store: str | os.PathLike | ParamStore | None = None,
    seed: int = 0,
    commit_every: int = 1,
    validate_every: int = 1,
    features: str | Sequence[str] | None = None,
    label: str | None = None,
    sample_dim: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    shuffle: bool = True,
    keep_updates: bool = False,
    tasks_per_slot: int = 2,
    resilience: Resilience | None = None,
    progress: bool = True,
) -> FitResult:
    """Train ``model`` on ``data`` with VC-ASGD on a Dask cluster.

    The data is split into ``n_shards`` shards; one epoch trains every shard once.
    Each shard task starts from the current server parameters, trains ``local_epochs``
    with a fresh optimizer, and its result is merged as it arrives:
    ``W_s <- alpha * W_s + (1 - alpha) * W_c``.  Every merge is a version in ``store``.

    Parameters
    ----------
    model : torch.nn.Module
        The model to train; it ends up holding the final server parameters.
    data : (X, y), xarray.Dataset, Zarr URL/path or Icechunk session
        Training data.  Arrays may be numpy, torch or dask.
    loss : str or callable, optional
        Default: cross-entropy for integer labels, MSE otherwise.
    optimizer : torch.optim.Optimizer subclass or callable, optional
        Default: Adam with learning rate ``lr``.  A fresh one is made for every shard.
    lr : float, default 1e-3
    max_epochs : int, default 10
    n_shards : int, optional
        Default: ``min(10, number of samples)``.
    local_epochs : int, default 1
        Passes over its shard that each task makes.
    batch_size : int, default 32
    merge : {"vc-asgd", "staleness", "nesterov", "sync"} or vcdask.rules.MergeRule, optional
        How the server folds each update in (see :mod:`vcdask.rules`).  Default:
        :data:`vcdask.rules.DEFAULT_RULE`, or ``"vc-asgd"`` when ``alpha`` is given.  The paper's rule,
        FedAsync's staleness-aware mixing, an outer Nesterov step per arrival (DiLoCo), or
        synchronous large-batch averaging (one merge per epoch's samples).  Configure a rule
        with an instance, e.g. ``vcdask.rules.Nesterov(lr=0.5)``.
    alpha : float, "epoch" or callable, optional
        For ``"vc-asgd"`` and ``"staleness"``: the server copy's weight, a constant in [0, 1],
        ``"epoch"`` for ``alpha_e = e / (e + 1)`` (vc-asgd's default), or ``epoch -> alpha``.
    target : dict, optional
        Stop once the validation metrics of an epoch's last version reach it, e.g. ``{"accuracy": 0.95}``.
    validation : float, (X, y) or same kinds as ``data``, optional
        Validation data, or the fraction of ``data`` to hold out.  With a ``target`` and
        no validation data, 10% is held out.
    metrics : list of names/callables or dict, optional
        Default: ``["accuracy"]`` for classification, ``["mae"]`` otherwise.
    client : distributed.Client or cluster, optional
        Where to run; default an embedded ``LocalCluster`` (one process per core), closed at the end.
    store : str, path or ParamStore, optional
        The parameter store; default the local directory ``./vcdask-runs``.  The run writes to branch ``run_id``.
    seed : int, default 0
    commit_every : int, default 1
        Commit a version every this many merges (epoch ends always commit).
    validate_every : int, default 1
        Validate every this many merges, when that merge was committed (epoch ends always).
    features, label, sample_dim : optional
        Variable and dimension names for xarray / Zarr data (inferred when unambiguous).
    storage_options : dict, optional
        fsspec options for a Zarr URL given as ``data``.
    shuffle : bool, default True
        Shuffle in-memory data once (seeded) before sharding.
    keep_updates : bool, default False
        Keep every client update (``history.update`` gives its path under ``<store>/runs``)
        instead of deleting it once its merge is committed: for audits and replays.
    tasks_per_slot : int, default 2
        Shard tasks kept in flight per worker thread (the paper's "simultaneous subtasks").
        2 keeps every worker busy while its last result travels and merges: on digits with
        2 workers it cut the run time by a third at equal accuracy (benchmarks/time_to_accuracy.py).
    resilience : Resilience, optional
        Deadlines, update checks and failure policies (see :class:`vcdask.Resilience`).
    progress : bool, default True
        Show progress (a tqdm bar).

    Returns
    -------
    FitResult

    Raises
    ------
    ValueError, TypeError
        Bad arguments, before any cluster work; messages name the value and the valid choices.
    RunFailedError
        The run failed on the cluster.
    """
    # ---- everything is checked before any cluster work ----
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_client(client)
    if merge is None:
        merge = "vc-asgd" if alpha is not None else DEFAULT_RULE
    rule = get_rule(merge, alpha)
    max_epochs = _positive_int("max_epochs", max_epochs)
    local_epochs = _positive_int("local_epochs", local_epochs)
    batch_size = _positive_int("batch_size", batch_size)
    commit_every = _positive_int("commit_every", commit_every)
    validate_every = _positive_int("validate_every", validate_every)
    tasks_per_slot = _positive_int("tasks_per_slot", tasks_per_slot)
    if resilience is None:
        resilience = Resilience()
    elif not isinstance(resilience, Resilience):
        raise TypeError(f"resilience must be a vcdask.Resilience, got {type(resilience).__name__}")
    if not isinstance(lr, (int, float)) or not lr > 0 or math.isinf(lr):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if validation is not None and isinstance(validation, (int, float)) and not isinstance(validation, bool):
        if not 0.0 < float(validation) < 1.0:
            raise ValueError(f"validation as a fraction must be in (0, 1), got {validation!r}")
        validation = float(validation)

    prepared = prepare_data(data, features=features, label=label, sample_dim=sample_dim,
                            storage_options=storage_options)
    classification = prepared.classification
    loss_fn = _resolve_loss(loss, classification)
    metric_fns = _resolve_metrics(metrics, classification)
    target = _check_target(target, list(metric_fns))
    x_dtype = _model_dtype(model)
    _check_model(model, prepared, loss_fn, classification, x_dtype)
    if target is not None and validation is None:
        logger.info("target given without validation data: holding out 10%% of the training data")
        validation = 0.1
    val_prepared = None
    if validation is not None and not isinstance(validation, float):
        val_prepared = prepare_data(validation, features=features, label=label, sample_dim=sample_dim,
                                    storage_options=storage_options, what="validation")
        if val_prepared.x_shape != prepared.x_shape:
            raise DataError(f"validation samples have shape {val_prepared.x_shape}, training samples "
                            f"{prepared.x_shape}")
    prepared, split_val = _split(prepared, validation, seed, shuffle)
    val_prepared = val_prepared or split_val
    if n_shards is None:
        n_shards = min(10, prepared.n)
    n_shards = _positive_int("n_shards", n_shards)
    if n_shards > prepared.n:
        raise ValueError(f"n_shards={n_shards} is more than the {prepared.n} training samples; "
                         f"choose 1 <= n_shards <= {prepared.n}")
    optimizer_fn = _resolve_optimizer(optimizer, lr)
    rule = get_rule(merge, alpha, samples_per_epoch=prepared.n)
    param_store = open_store(DEFAULT_STORE if store is None else store)
    if not param_store.shared_across_processes and client is None:
        raise ValueError(f"store {param_store.location!r} lives in this process only, but the embedded cluster "
                         "runs worker processes; use a directory or object-store location, or pass a client "
                         "whose workers run in this process (LocalCluster(processes=False))")

    # ---- cluster work ----
    t0 = time.perf_counter()
    run_id = f"run-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    with resolve_client(client) as c:
        if not param_store.shared_across_processes:
            pids = set(c.run(os.getpid).values())
            if pids != {os.getpid()}:
                raise ValueError(f"store {param_store.location!r} lives in this process only, but the workers "
                                 "run in other processes; use a directory or object-store location")
        param_store.create_branch(run_id)
        train_src = prepared.source or stage(prepared, param_store.files, f"{run_id}/train.zarr", client=c)
        val_src = None
        if val_prepared is not None:
            val_src = val_prepared.source or stage(val_prepared, param_store.files, f"{run_id}/validation.zarr",
                                                    client=c)
        param_store.commit(model, {"run_id": run_id, "step": 0, "epoch": 0, "merged": []}, branch=run_id,
                           message=f"{run_id} initial parameters")
        if isinstance(rule, Nesterov):  # its default delay: one momentum step per tasks-in-flight arrivals
            threads = sum(c.nthreads().values()) or 1
            rule = rule.in_flight(tasks_per_slot * threads)
        spec = RunSpec(
            run_id=run_id, store=param_store, branch=run_id, model=copy.deepcopy(model).cpu(), loss=loss_fn,
            optimizer=optimizer_fn, local_epochs=local_epochs, batch_size=batch_size, seed=seed,
            train=train_src, shards=Shards(prepared.n, n_shards), validation=val_src, metrics=metric_fns,
            classification=classification, x_dtype=x_dtype, max_epochs=max_epochs, merge=rule,
            target=target, commit_every=commit_every, validate_every=validate_every, keep_updates=keep_updates,
            tasks_per_slot=tasks_per_slot, resilience=resilience,
        )
        import cloudpickle

        param_store.files.put(spec.spec_path, cloudpickle.dumps(spec))
        ensure_plugin(c)
        c.sync(c.scheduler.vcdask_start, store=pickle.dumps(param_store), run_id=run_id)
        handle = RunHandle(run_id, c)
        handle.wait(progress=progress)
        return handle.result(model=model, wall_time=time.perf_counter() - t0)


def resume(run_id: str, *, store: str | os.PathLike | ParamStore | None = None, client: Any = None,
           progress: bool = True) -> FitResult:
    """Continue a run whose scheduler died, on any cluster that can reach its store.

    The run restarts from the newest committed version on its branch, first merges the client
    updates that were uploaded but never committed, merges none twice (the versions' metadata
    lists every merged (epoch, shard)), and trains the shards and epochs that are left.

    Parameters
    ----------
    run_id : str
    store : str, path or ParamStore, optional
        The run's store (default ``./vcdask-runs``).
    client : distributed.Client or cluster, optional
        Default: an embedded LocalCluster.
    progress : bool, default True

    Returns
    -------
    FitResult
        Its ``history`` lists the updates merged after the restart.

    Raises
    ------
    VersionNotFoundError
        The store has no branch ``run_id`` (the message lists the runs it has).
    """
    from .errors import VersionNotFoundError

    check_client(client)
    param_store = open_store(DEFAULT_STORE if store is None else store, mode="r+")
    if run_id not in param_store.branches() or not param_store.files.exists(f"{run_id}/spec.pkl"):
        runs = sorted(b for b in param_store.branches() if param_store.files.exists(f"{b}/spec.pkl"))
        raise VersionNotFoundError(f"no run {run_id!r} in {param_store.location!r}; runs: {runs}")
    t0 = time.perf_counter()
    with resolve_client(client) as c:
        ensure_plugin(c)
        c.sync(c.scheduler.vcdask_start, store=pickle.dumps(param_store), run_id=run_id, resume=True)
        handle = RunHandle(run_id, c)
        handle.wait(progress=progress)
        return handle.result(wall_time=time.perf_counter() - t0)
