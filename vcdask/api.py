"""``vcdask.fit`` and ``vcdask.resume``: check and coerce the inputs, then hand a run to the scheduler plugin.

One path for both: inputs -> :class:`~vcdask.spec.RunSpec` (saved in the store) -> the scheduler
plugin starts the run -> wait with a progress display -> :class:`~vcdask.FitResult`.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import torch

from .cluster import check_client, resolve_client
from .data import Shards
from .errors import VersionNotFoundError
from .handle import FitResult, RunHandle, ensure_plugin
from .options import DEFAULT_STORE, RunPlan, plan_run
from .resilience import Resilience
from .spec import RunSpec, save_spec, spec_path
from .staging import stage
from .store import ParamStore, Retention, check_cluster_access, open_store, share_credentials, store_holds_secrets

logger = logging.getLogger(__name__)

__all__ = ["fit", "resume"]


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
    commit_every: int | str = 1,
    validate_every: int = 1,
    features: str | Sequence[str] | None = None,
    label: str | None = None,
    sample_dim: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    shuffle: bool = True,
    keep_updates: bool = False,
    tasks_per_slot: int = 1,
    resilience: Resilience | None = None,
    retention: Retention | bool | None = None,
    progress: bool = True,
    train_step: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    eval_step: Callable[[torch.nn.Module, Any], Mapping[str, Any]] | None = None,
    collate_fn: Callable | None = None,
    device: str | torch.device = "auto",
    precision: str = "32",
    optimizer_state: str = "fresh",
    lr_schedule: Callable[[int, int], float] | None = None,
    clip_grad_norm: float | None = None,
    compression: str | None = None,
    speed_adaptive: bool = False,
) -> FitResult:
    """Train ``model`` on ``data`` with VC-ASGD on a Dask cluster.

    The data is split into ``n_shards`` shards; one epoch trains every shard once.
    Each shard task starts from the current server parameters, trains ``local_epochs``
    on its worker's device, and its result is merged as it arrives (by default an outer
    Nesterov step on ``W_c - W_s``; the paper's ``W_s <- alpha * W_s + (1 - alpha) * W_c`` with
    ``merge="vc-asgd"``).  Every merge is a version in ``store``.

    Parameters
    ----------
    model : torch.nn.Module
        The model to train; it ends up holding the final server parameters.
    data : (X, y), dict of arrays, xarray.Dataset, Zarr URL/path, Icechunk session or torch Dataset
        Training data.  Arrays may be numpy, torch or dask.  A batch mirrors the data: ``(x, y)``
        for ``(X, y)``; a dict of tensors for a dict of arrays, and for xarray / Zarr data when a
        ``train_step`` is given (one entry per variable); a map-style ``torch.utils.data.Dataset``
        is sharded by index ranges and its items put together by ``collate_fn``.
    loss : str or callable, optional
        For the default step: cross-entropy for integer labels, MSE otherwise.
    optimizer : torch.optim.Optimizer subclass or callable, optional
        Default: Adam with learning rate ``lr``.  Its state is kept per worker between shard tasks
        (``optimizer_state``).
    lr : float, default 1e-3
    max_epochs : int, default 10
    n_shards : int, optional
        Default: two per worker thread of the cluster when the run starts (at least 2, at most the
        number of samples), so each worker trains two shards an epoch.  Pass it for a cluster that
        will grow during the run (an epoch has at most ``n_shards`` tasks to share out) or to fix the
        split whatever the cluster.
    local_epochs : int, default 1
        Passes over its shard that each task makes.
    batch_size : int, default 32
    merge : {"vc-asgd", "staleness", "nesterov", "sync"} or vcdask.merge.MergeRule, optional
        How the server folds each update in (see :mod:`vcdask.merge`).  Default:
        :data:`vcdask.merge.DEFAULT_RULE`, or ``"vc-asgd"`` when ``alpha`` is given.  The paper's rule,
        FedAsync's staleness-aware mixing, an outer Nesterov step per arrival (DiLoCo), or
        synchronous large-batch averaging (one merge per epoch's samples).  Configure a rule
        with an instance, e.g. ``vcdask.merge.Nesterov(lr=0.5)``.
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
    commit_every : int or "auto", default 1
        Commit a version every this many merges (epoch ends always commit).  ``"auto"``: every merge,
        except that results already queued behind a merge share its commit (up to 8): a merge thread
        that falls behind catches up (``benchmarks/merge_bound.py``: 6.4 -> 10.6 merges per second).
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
    tasks_per_slot : int, default 1
        Shard tasks kept in flight per worker thread (the paper's "simultaneous subtasks").  A
        worker gets its next shard as soon as its result is back, so one is enough to keep it
        busy; each more task in flight makes every update one merge staler.  Over the four tasks
        of ``benchmarks/defaults.py`` 1 was as accurate as or more accurate than 2 (tabular: 0.929
        against 0.850, torch 0.938); 2 can still help where a worker's round trip to the scheduler
        is long against its tasks.
    resilience : Resilience, optional
        Deadlines, update checks and failure policies (see :class:`vcdask.Resilience`).
    retention : Retention or False, optional
        Which versions the run keeps in its store (see :class:`vcdask.Retention`).  Default: the
        newest 5, each epoch's last version and every tagged one; the others are removed during the
        run, and only the newest version keeps the merge rule's state.  ``False`` keeps every version.
    progress : bool, default True
        Show progress (a tqdm bar).
    train_step : callable, optional
        ``train_step(model, batch) -> loss tensor`` for models that are not ``model(X) -> output``
        (batches are already on the worker's device).  Default: ``loss(model(x), y)``.
    eval_step : callable, optional
        ``eval_step(model, batch) -> {"name": value}`` (with ``train_step``): run without gradients on
        the validation batches; each value is averaged weighted by batch size and becomes a column of
        ``FitResult.epochs`` (and may be a ``target``).  Default with ``train_step``: its loss.
    collate_fn : callable, optional
        For a torch ``Dataset``: items -> batch (default ``torch.utils.data.default_collate``).
    device : {"auto", "cpu", "cuda", "cuda:N", "mps"} or torch.device, default "auto"
        Where each worker trains: ``"auto"`` takes the worker's own accelerator, so one run can mix
        GPU and CPU workers.  Parameters travel and merge on CPU.
    precision : {"32", "bf16", "16-mixed"}, default "32"
        ``"bf16"``: bfloat16 autocast; ``"16-mixed"``: float16 autocast with a gradient scaler.
        Parameters stay in the model's dtype.
    optimizer_state : {"fresh", "worker"}, default "fresh"
        ``"fresh"``: a new optimizer for every shard task (the paper).  ``"worker"``: each worker keeps
        its optimizer state (e.g. Adam's moments) between its tasks of this run (see
        :mod:`vcdask.inner`).  Over the four tasks of ``benchmarks/defaults.py`` "fresh" met the bar
        (within 1 point, or 3% of loss, of single-process torch) on three and "worker" on two: "worker"
        was 1.4 points better on digits, and 12% worse in loss on the char-LM (AdamW at 5e-3, 2 local
        steps per task), where the kept moments add their own momentum to the outer rule's.
    lr_schedule : callable, optional
        ``lr_schedule(epoch, step) -> factor`` scales the learning rate at every local step
        (``epoch`` of the run, from 1; ``step`` within the task, from 0).
    clip_grad_norm : float, optional
        Clip the gradients' total norm to this before every local step.
    compression : {None, "fp16", "bf16", "int8", "int4"}, optional
        Send each update as its difference from the version it trained from, in fewer bits
        (``"int8"``: about a quarter of the bytes), with error feedback on the worker (see
        :mod:`vcdask.compress`).  Default: the full float32 ``W_c``.
    speed_adaptive : bool, default False
        Size each task to its worker's measured speed: a worker slower than the fastest one trains
        that share of its shard's batches (at least a tenth), so its task takes about as long as a
        fast worker's and its update is no staler (``history.fraction``).  A slow worker then trains
        fewer samples in an epoch.

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
    plan = plan_run(
        model,
        data,
        loss=loss,
        optimizer=optimizer,
        lr=lr,
        max_epochs=max_epochs,
        n_shards=n_shards,
        local_epochs=local_epochs,
        batch_size=batch_size,
        merge=merge,
        alpha=alpha,
        target=target,
        validation=validation,
        metrics=metrics,
        client=client,
        store=store,
        seed=seed,
        commit_every=commit_every,
        validate_every=validate_every,
        features=features,
        label=label,
        sample_dim=sample_dim,
        storage_options=storage_options,
        shuffle=shuffle,
        keep_updates=keep_updates,
        tasks_per_slot=tasks_per_slot,
        resilience=resilience,
        retention=retention,
        train_step=train_step,
        eval_step=eval_step,
        collate_fn=collate_fn,
        device=device,
        precision=precision,
        optimizer_state=optimizer_state,
        lr_schedule=lr_schedule,
        clip_grad_norm=clip_grad_norm,
        compression=compression,
        speed_adaptive=speed_adaptive,
    )
    t0 = time.perf_counter()
    run_id = f"run-{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    with resolve_client(client) as c:
        _check_cluster(c, plan.store, embedded=client is None)
        plan.store.create_branch(run_id)
        save_spec(_stage(plan, run_id, c))
        return _launch(c, plan.store, run_id, progress=progress, model=model, t0=t0)


def _check_cluster(c, store: ParamStore, *, embedded: bool) -> None:
    """What the cluster must offer before a run starts: workers (and a scheduler) that can open the store.

    A store opened here with explicit credentials pickles without them: the embedded cluster (our own
    processes on this machine) is given them with :func:`~vcdask.store.share_credentials`; any other
    cluster must resolve them itself, and :func:`~vcdask.store.check_cluster_access` says so, naming
    the remedies, before the run starts.
    """
    if not store.shared_across_processes:
        pids = set(c.run(os.getpid).values())
        if pids != {os.getpid()}:
            raise ValueError(
                f"store {store.location!r} lives in this process only, but the workers "
                "run in other processes; use a directory or object-store location"
            )
        return
    if store_holds_secrets(store):
        if embedded:
            share_credentials(c, store)
        check_cluster_access(store, c)


def _stage(plan: RunPlan, run_id: str, c) -> RunSpec:
    """Stage in-memory data in the store, commit the initial version, and describe the run."""
    store = plan.store
    train = plan.train.source or stage(plan.train, store.files, f"{run_id}/train.zarr", client=c)
    val = None
    if plan.validation is not None:
        val = plan.validation.source or stage(plan.validation, store.files, f"{run_id}/validation.zarr", client=c)
    store.commit(
        plan.model,
        {"run_id": run_id, "step": 0, "epoch": 0, "merged": []},
        branch=run_id,
        message=f"{run_id} initial parameters",
    )
    in_flight = plan.options["tasks_per_slot"] * (sum(c.nthreads().values()) or 1)
    return RunSpec(
        run_id=run_id,
        store=store,
        branch=run_id,
        model=copy.deepcopy(plan.model).cpu(),
        loss=plan.loss,
        optimizer=plan.optimizer,
        train=train,
        shards=(
            Shards(plan.train.n, plan.n_shards)
            if plan.n_shards is not None
            else Shards.default(plan.train.n, sum(c.nthreads().values()))
        ),
        validation=val,
        metrics=plan.metrics,
        classification=plan.train.classification,
        x_dtype=plan.x_dtype,
        merge=plan.rule.for_run(in_flight=in_flight),
        target=plan.target,
        **plan.options,
    )


def _launch(
    c,
    store: ParamStore,
    run_id: str,
    *,
    resume: bool = False,
    progress: bool = True,
    model: torch.nn.Module | None = None,
    t0: float,
) -> FitResult:
    """Start (or resume) the run on the scheduler, wait for it, and collect its result."""
    ensure_plugin(c)
    c.sync(c.scheduler.vcdask_start, store=pickle.dumps(store), run_id=run_id, resume=resume)
    handle = RunHandle(run_id, c)
    handle.wait(progress=progress)
    return handle.result(model=model, wall_time=time.perf_counter() - t0)


def resume(
    run_id: str, *, store: str | os.PathLike | ParamStore | None = None, client: Any = None, progress: bool = True
) -> FitResult:
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
    check_client(client)
    param_store = open_store(DEFAULT_STORE if store is None else store, mode="r+")
    if run_id not in param_store.branches() or not param_store.files.exists(spec_path(run_id)):
        runs = sorted(b for b in param_store.branches() if param_store.files.exists(spec_path(b)))
        raise VersionNotFoundError(f"no run {run_id!r} in {param_store.location!r}; runs: {runs}")
    t0 = time.perf_counter()
    with resolve_client(client) as c:
        _check_cluster(c, param_store, embedded=client is None)
        return _launch(c, param_store, run_id, resume=True, progress=progress, t0=t0)
