"""Starting runs on a cluster: the launch path :func:`vcdask.fit` ends in, and :func:`vcdask.resume`.

From a checked :class:`~vcdask.options.RunPlan`: stage the data, commit the initial version, save the
:class:`~vcdask.spec.RunSpec`, start the run on the scheduler plugin, then wait for it (or hand back
its :class:`~vcdask.RunHandle` at once).  Also the checks of the run-lifecycle options (early
stopping, ``resume(max_epochs=)``: :mod:`vcdask.extend`) and where a run's initial parameters came from.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import pickle
import secrets
import time
from datetime import UTC, datetime
from typing import Any, Literal, overload

import torch

from ._ints import positive_int
from ._main_guard import may_start_here
from .cluster import check_client, in_task, owns_client, resolve_client
from .data import Shards
from .device import cpu_copy
from .engine.end import read_record
from .errors import SchedulerEnvironmentError
from .extend import check_extend, epochs_done, keep_max_epochs
from .handle import FitResult, RunHandle, ensure_plugin
from .holdout import check_early_stopping
from .inner import memory_steps, resolve_optimizer_state
from .launching import check_cluster, discard_run, let_go_of_rows, run_client, wait_for
from .merge import DEFAULT_RULE, for_run
from .metrics import label_shape
from .options import RunPlan
from .reach import check_not_live_elsewhere, run_id_of, run_store
from .spec import RunSpec, load_spec, save_spec
from .staging import in_memory, stage
from .steps import eval_modules
from .store import ParamStore
from .store._runs import check_staged
from .variables import recorded_features

logger = logging.getLogger(__name__)

__all__ = ["check_early_stopping", "epochs_done", "launch", "new_run_id", "resume", "start_record"]


def new_run_id() -> str:
    """A fresh run id: ``run-<UTC time>-<6 hex digits>`` (also the run's branch in its store)."""
    return f"run-{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def start_record(model: torch.nn.Module, store: ParamStore) -> dict[str, Any] | None:
    """Where ``model``'s parameters come from: ``{"version", "tag", "store"}`` for a model that
    :func:`vcdask.load` (or a finished ``fit``) filled from a store, None for any other."""
    loaded = getattr(model, "vcdask_version", None)
    if not isinstance(loaded, dict) or not loaded.get("id"):
        return None
    return {"version": loaded["id"], "tag": loaded.get("tag"), "store": loaded.get("store", store.location)}


def launch(
    plan: RunPlan,
    client: Any,
    model: torch.nn.Module,
    *,
    wait: bool,
    progress: bool,
) -> FitResult | RunHandle:
    """Stage, commit the initial version, start the run; wait for it (``wait``) or return its handle.

    In-memory data for the embedded cluster is staged in a thread while that cluster starts (seconds,
    the first time in a process; not from a script's unguarded top level, where it will not start: see
    :func:`~vcdask._main_guard.check_main_guard`); a cluster of the caller's may write dask data itself, so
    it is there first.  A launch that fails before the run's spec is saved (the cluster did not start, the
    staging failed) deletes the run's branch and folder: without a spec, ``vcdask runs`` would not list
    them, and the copy of the data would stay.
    """
    t0 = time.perf_counter()
    run_id = new_run_id()
    start = start_record(model, plan.store)
    early = None
    if client is None and _in_memory(plan) and may_start_here():
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vcdask-stage")
        early = pool.submit(_stage_data, plan, run_id, None, start)
        pool.shutdown(wait=False)
    saved = False
    try:
        with run_client(plan, client, keep=not wait) as c:
            check_cluster(c, plan.store, embedded=client is None and not in_task(), device=str(plan.training.device))
            staged = early.result() if early is not None else _stage_data(plan, run_id, c, start)
            spec = _stage(plan, run_id, c, *staged)
            save_spec(dataclasses.replace(spec, start=start))
            saved = True
            let_go_of_rows(plan)
            try:
                handle = _start(
                    c, plan.store, run_id, model=model, setup_seconds=time.perf_counter() - t0, owns=owns_client(client)
                )
            except SchedulerEnvironmentError:  # the scheduler could not read the spec: the run never started
                saved = False  # (nothing of it is left: `vcdask runs` would list it, incomplete)
                raise
            if not wait:
                return handle
            wait_for(handle, progress)
            return handle.result(wall_time=time.perf_counter() - t0)
    except BaseException:
        if early is not None:  # (nothing writes to the store once it is done and fit has raised)
            concurrent.futures.wait([early])
        if not saved:
            discard_run(plan.store, run_id)
        raise


def _in_memory(plan: RunPlan) -> bool:
    """Whether the run's data is staged from this process (numpy or torch arrays, no dask)."""
    parts = [p for p in (plan.train, plan.validation) if p is not None]
    return all(p.source is None and in_memory(p) for p in parts)


def _stage_data(plan: RunPlan, run_id: str, c, start: dict[str, Any] | None) -> tuple[Any, Any]:
    """The run's branch, its data staged in the store (dask data written by ``c``'s workers, when given)
    and its initial version committed; the sources of the training and validation data."""
    store = plan.store
    store.create_branch(run_id)
    train = plan.train.source or stage(plan.train, store.files, f"{run_id}/train.zarr", client=c, dtype=plan.x_dtype)
    val = None
    if plan.validation is not None:
        val = plan.validation.source or stage(
            plan.validation, store.files, f"{run_id}/validation.zarr", client=c, dtype=plan.x_dtype
        )
    store.commit(
        plan.model,
        # max_epochs: what `vcdask runs` shows for a run without a record (it never unpickles the spec)
        {"run_id": run_id, "step": 0, "epoch": 0, "merged": [], "start": start, "max_epochs": plan.max_epochs},
        branch=run_id,
        message=f"{run_id} initial parameters" + (f" (from version {start['version']})" if start else ""),
    )
    return train, val


def _stage(plan: RunPlan, run_id: str, c, train: Any, val: Any) -> RunSpec:
    """Describe the run, its data staged (:func:`_stage_data`), for the cluster of ``c``."""
    store = plan.store
    merging, training, stopping = plan.merging, plan.training, plan.stopping
    in_flight = merging.tasks_per_slot * (sum(c.nthreads().values()) or 1)
    shards = (
        Shards(plan.train.n, plan.n_shards)
        if plan.n_shards is not None
        else Shards.default(plan.train.n, sum(c.nthreads().values()), training.batch_size)
    )
    return RunSpec(
        run_id=run_id,
        store=store,
        branch=run_id,
        model=cpu_copy(plan.model),
        loss=plan.loss,
        optimizer=plan.optimizer,
        local_epochs=training.local_epochs,
        batch_size=training.batch_size,
        seed=plan.seed,
        train=train,
        shards=shards,
        validation=val,
        metrics=plan.metrics,
        classification=plan.train.classification,
        label_range=plan.train.label_range,
        x_dtype=plan.x_dtype,
        max_epochs=plan.max_epochs,
        merge=for_run(plan.rule, in_flight=in_flight),  # (the default rule: one in flight, no outer step)
        merge_in_flight=in_flight if plan.rule is DEFAULT_RULE else None,
        target=None if stopping.target is None else dict(stopping.target),
        commit_every=merging.commit_every,  # type: ignore[arg-type]  # an int, or "auto" (engine.committing)
        validate_every=stopping.validate_every,
        keep_updates=plan.keep_updates,
        tasks_per_slot=merging.tasks_per_slot,
        resilience=plan.resilience,
        device=training.device,  # type: ignore[arg-type]  # a string once checked (Training.__post_init__)
        precision=training.precision,
        train_step=plan.train_step,
        eval_step=plan.eval_step,
        metric_names=plan.step_metrics,
        batch_form=plan.train.form,
        cast_x=plan.cast_x,
        optimizer_state=_optimizer_state(plan, shards),
        lr_schedule=training.lr_schedule,
        clip_grad_norm=training.clip_grad_norm,
        retention=plan.retention,
        compression=merging.compression,
        speed_adaptive=merging.speed_adaptive,
        prices=plan.prices,
        feature_names=recorded_features(plan.train),
        patience=stopping.patience,
        monitor=stopping.monitor,
        overlap=plan.overlap,
        label_shape=label_shape(plan.train),
        eval_modules=eval_modules(plan.model),  # (frozen batch-norm layers stay frozen on the workers)
    )


def _optimizer_state(plan: RunPlan, shards: Shards) -> str:
    """``optimizer_state``, with ``"auto"`` decided from the run's shortest task (see :mod:`vcdask.inner`)."""
    training = plan.training
    value = training.optimizer_state
    if value != "auto":
        return value
    steps = shards.local_steps(training.batch_size, training.local_epochs)
    optimizer = plan.optimizer(list(plan.model.parameters()))
    state = resolve_optimizer_state(value, optimizer, steps)
    logger.info(
        "optimizer_state='auto' is %r: %d local steps per task, the optimizer's first moment remembers %.3g",
        state,
        steps,
        memory_steps(optimizer),
    )
    return state


def _start(
    c,
    store: ParamStore,
    run_id: str,
    *,
    resume: bool = False,
    max_epochs: int | None = None,
    model: torch.nn.Module | None = None,
    setup_seconds: float = 0.0,
    owns: bool = False,
) -> RunHandle:
    """Start (or resume) the run on the scheduler; its handle (owning ``c`` with ``owns``: it closes it)."""
    ensure_plugin(c)
    holder = secrets.token_hex(8)  # (what this handle holds the run's session by: it lets go when dropped)
    start = {"store": pickle.dumps(store), "run_id": run_id, "resume": resume, "max_epochs": max_epochs}
    c.sync(c.scheduler.vcdask_start, **start, holder=holder)
    return RunHandle(run_id, c, model, setup_seconds=setup_seconds, owns_client=owns, holder=holder)


@overload
def resume(
    run_id: str | FitResult | RunHandle,
    *,
    store: str | os.PathLike | ParamStore | None = None,
    client: Any = None,
    progress: bool = True,
    max_epochs: int | None = None,
    wait: Literal[True] = True,
) -> FitResult: ...


@overload
def resume(
    run_id: str | FitResult | RunHandle,
    *,
    store: str | os.PathLike | ParamStore | None = None,
    client: Any = None,
    progress: bool = True,
    max_epochs: int | None = None,
    wait: Literal[False],
) -> RunHandle: ...


@overload
def resume(
    run_id: str | FitResult | RunHandle,
    *,
    store: str | os.PathLike | ParamStore | None = None,
    client: Any = None,
    progress: bool = True,
    max_epochs: int | None = None,
    wait: bool = True,
) -> FitResult | RunHandle: ...


def resume(
    run_id: str | FitResult | RunHandle,
    *,
    store: str | os.PathLike | ParamStore | None = None,
    client: Any = None,
    progress: bool = True,
    max_epochs: int | None = None,
    wait: bool = True,
) -> FitResult | RunHandle:
    """Continue a run whose scheduler died, or give a finished run more epochs, on any cluster that can
    reach its store.

    The run restarts from the newest committed version on its branch, first merges the client
    updates that were uploaded but never committed, merges none twice (the versions' metadata
    lists every merged (epoch, shard)), and trains the shards and epochs that are left.  A run still ending on
    the same scheduler (just stopped or cancelled) is waited for, then continued; one still going on another
    scheduler is refused.

    Parameters
    ----------
    run_id : str, FitResult or RunHandle
        The run's id; a result or handle of the run stands for its own, and for its store.
    store : str, path or ParamStore, optional
        The run's store.  Default: a result's own store (``FitResult.store``); a handle's once it holds its
        run's result (after ``handle.result()`` or ``handle.cancel()``: before, a handle knows only the run's
        id, so pass ``store=`` unless the run is in ``./vcdask-runs``); for a run id, ``./vcdask-runs``.  A
        ``store=`` given is the one searched, over a result's own.
    client : distributed.Client or cluster, optional
        Default: the process's embedded LocalCluster (see :func:`vcdask.fit`).
    progress : bool, default True
    max_epochs : int, optional
        Train up to this many epochs in all (more than the run has done): extends a finished run
        (or one that stopped early), from its last version.  The run's spec keeps the new number.  A schedule
        over the run (:mod:`vcdask.lr_schedules`) becomes that of a run of ``max_epochs``: a cosine that had
        decayed starts the added epochs part way up again.  Default: the run's own ``max_epochs``.
    wait : bool, default True
        False: return the run's :class:`~vcdask.RunHandle` at once (see :func:`vcdask.fit`).

    Returns
    -------
    FitResult or RunHandle
        Its ``history`` lists the updates merged after the restart; ``epochs`` every epoch.

    Raises
    ------
    VersionNotFoundError
        The store has no branch ``run_id`` (the message lists the runs it has; for a handle that does not hold
        its run's store, it says to pass ``store=``).
    ValueError
        ``max_epochs`` is not more than the epochs the run has done (both named).
    FileNotFoundError
        The copy of the run's data staged in the store was removed, ``Retention.keep_staged_for`` after the run
        ended: the message says when and how to train its model on (its versions stay).
    RunLiveElsewhereError
        The run still goes on at another scheduler (the one its record names, asked for a few seconds: one gone
        is not in the way); the message names it and how to follow the run there (:func:`vcdask.attach`).
    TypeError
        ``run_id`` is not a str (nor a result or handle).

    Warns
    -----
    UserWarning
        ``max_epochs`` changes the learning rate of a schedule over the run where the added epochs start
        (:func:`vcdask.extend.schedule_restart`: both factors, and what to do instead).

    Examples
    --------
    >>> result = vcdask.fit(model, (X, y), max_epochs=5)                  # doctest: +SKIP
    >>> more = vcdask.resume(result.run_id, max_epochs=8)                 # 3 more epochs  # doctest: +SKIP
    """
    run = run_id
    run_id = run_id_of(run, "resume")
    check_client(client)
    if max_epochs is not None:
        max_epochs = positive_int("max_epochs", max_epochs)
    param_store = run_store(run, run_id, store)
    check_staged(param_store.files, run_id)  # (its data staged in the store, removed by its retention)
    if max_epochs is not None:
        check_extend(param_store, run_id, max_epochs)  # (and a schedule over the run that starts again, said)
    t0 = time.perf_counter()
    with resolve_client(client, keep=not wait) as c:
        check_not_live_elsewhere(read_record(param_store, run_id), run_id, c)  # (one driver a run)
        device = str(getattr(load_spec(param_store, run_id), "device", "auto"))
        check_cluster(c, param_store, embedded=client is None and not in_task(), device=device)
        handle = _start(c, param_store, run_id, resume=True, max_epochs=max_epochs, owns=owns_client(client))
        if max_epochs is not None:  # the start was accepted (a live run is refused): the spec keeps it
            keep_max_epochs(param_store, run_id, max_epochs)
        if not wait:
            return handle
        wait_for(handle, progress)
        return handle.result(wall_time=time.perf_counter() - t0)
