"""``vcdask.fit`` and ``vcdask.resume``: check and coerce the inputs, then hand a run to the scheduler plugin.

One path for both: inputs -> :class:`~vcdask.spec.RunSpec` (saved in the store) -> the scheduler
plugin starts the run -> wait with a progress display -> :class:`~vcdask.FitResult`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ._ints import check_bool
from ._keywords import suggests_keywords
from .groups import Merging, Stopping, Training, fold
from .handle import FitResult, RunHandle
from .lr_schedules import RunSchedule
from .options import plan
from .resilience import Resilience
from .runs import launch, resume
from .store import ParamStore, Retention

logger = logging.getLogger(__name__)

__all__ = ["fit", "resume"]


@suggests_keywords
def fit(
    model: torch.nn.Module,
    data: Any,
    *extra: Any,
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
    validate_every: int | str = "auto",
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
    optimizer_state: str = "auto",
    lr_schedule: Callable[[int, int], float] | RunSchedule | None = None,
    clip_grad_norm: float | None = None,
    compression: str | None = None,
    speed_adaptive: bool = False,
    patience: int | None = None,
    monitor: str | None = None,
    merging: Merging | None = None,
    training: Training | None = None,
    stopping: Stopping | None = None,
    wait: bool = True,
) -> FitResult | RunHandle:
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
    data : (X, y), pandas DataFrame, dict of arrays, xarray.Dataset, Zarr URL/path, Icechunk session or torch Dataset
        Training data.  Arrays may be numpy, torch or dask; ``(X, y)`` may also be ``(DataFrame, Series)``,
        and a whole DataFrame takes ``label=`` (numeric / bool feature columns, as float32).  A batch
        mirrors the data: ``(x, y)`` for ``(X, y)``; a dict of tensors for a dict of arrays, and for
        xarray / Zarr data when a ``train_step`` is given (one entry per variable); a map-style
        ``torch.utils.data.Dataset`` is sharded by index ranges and its items put together by ``collate_fn``.
    *extra
        Nothing: the data is one argument, ``fit(model, (X, y))``.  scikit-learn's ``fit(model, X, y)``
        gets a ``TypeError`` that says so.
    loss : str or callable, optional
        For the default step: cross-entropy for integer labels, MSE otherwise.  A name (``"cross_entropy"``,
        ``"mse"``, ``"l1"``, ``"nll"``), a function ``(output, target) -> scalar tensor`` or a loss module
        instance (``torch.nn.CrossEntropyLoss(weight=w)``, not the class; each worker copies its tensors to its
        device, as it does a ``functools.partial``'s, ``partial(F.cross_entropy, weight=w)``).  A loss that is
        not one number for the batch (``reduction="none"``) is refused.
    optimizer : torch.optim.Optimizer subclass or callable, optional
        Default: Adam with learning rate ``lr``.  A class, a ``functools.partial`` of one, or a function
        ``params -> optimizer``: each worker calls it with a list of its copy's parameters (in
        ``model.named_parameters()`` order), so build parameter groups from ``params``, not from your model.
        It is built once on a copy of the model before any cluster work, and refused (``ValueError``) when it
        holds parameters that are not the copy's or needs a closure (LBFGS); a trainable parameter in no group
        (``SGD(params[-2:])``, the head only) is a ``UserWarning``: it gets gradients but no step (freeze it,
        ``requires_grad_(False)``, to skip its backward).  Whether its state lives on between a worker's shard
        tasks: ``optimizer_state``.
    lr : float, default 1e-3
        The learning rate of the default Adam, of an optimizer class, and of a ``functools.partial`` of one that
        sets no ``lr`` (a partial that sets another is refused).  A function ``params -> optimizer`` sets its
        own: an ``lr`` other than the default that none of its optimizer's groups uses cannot be applied, and is
        refused.
    max_epochs : int, default 10
    n_shards : int, optional
        Default: as many per worker thread of the cluster when the run starts as leave each task at
        least 8 batches of ``batch_size`` rows, from two to eight per thread (2 for a cluster of one
        thread; at most the number of samples), so each worker trains the same number of shards an
        epoch (:meth:`vcdask.data.Shards.default`).  Pass it for a cluster that
        will grow during the run (an epoch has at most ``n_shards`` tasks to share out) or to fix the
        split whatever the cluster.
    local_epochs : int, default 1
        Passes over its shard that each task makes.
    batch_size : int, default 32
    merge : {"vc-asgd", "staleness", "nesterov", "sync", "probe", "auto"} or vcdask.merge.MergeRule, optional
        How the server folds each update in (see :mod:`vcdask.merge`).  Default, by the tasks in flight:
        one (a cluster of one worker thread), :data:`vcdask.merge.ONE_IN_FLIGHT` (each update taken as it
        is); 2 or 3, :data:`vcdask.merge.DEFAULT_RULE` (delayed Nesterov); 4 or more,
        :class:`vcdask.merge.Auto` over it (the ``"probe"`` rule where the server's probe costs little next
        to a task, timed at the first merge, else delayed Nesterov); a fleet that grows during the run
        moves up to the default for its new count, never down.  ``"vc-asgd"`` when ``alpha`` is
        given.  The paper's rule,
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
        no validation data, 10% is held out.  Otherwise nothing is held out by default, as Keras's
        ``validation_split=0.0`` and scikit-learn's estimators do (a hold-out costs training samples
        and worker time): the result then says it was not validated (``FitResult.notes``, the panel's
        title), and warns when the training loss diverged (:mod:`vcdask.diagnose`).
    metrics : list of names/callables or dict, optional
        Default: ``["accuracy"]`` for classification (integer labels, or float 0/1 labels of one logit each,
        trained with ``binary_cross_entropy_with_logits``), ``["mae"]`` otherwise.  A classifier's ``"mae"`` and
        ``"mse"`` are the errors of its predicted class ids.
    client : distributed.Client, cluster or scheduler address, optional
        Where to run: a client (left open), a cluster object or a scheduler's address
        (``"tcp://10.0.0.5:8786"``: the run opens a client of its own, and closes it when ``fit`` returns;
        with ``wait=False`` the handle closes it).  Dask data is checked there too (its first rows, the
        labels' range, the NaN / inf scan), through that same client, connected at the first check that computes
        (none for data in memory).  Default: the process's embedded ``LocalCluster`` (one
        worker process per core), started by the first ``fit`` and shared by every later ``fit`` and
        :func:`resume` of the process, closed when the interpreter exits (:func:`vcdask.cluster.embedded_client`).  Its
        workers are spawned, so a script must call ``fit`` under ``if __name__ == "__main__":``
        (a script without the guard gets a :class:`~vcdask.errors.MainGuardError` before any
        process starts).
    store : str, path or ParamStore, optional
        The parameter store; default the local directory ``./vcdask-runs``.  The run writes to branch ``run_id``.
    seed : int, default 0
        An integer >= 0: seeds the shuffle, the held-out split, each epoch's order of shards and each task's
        batch order and dropout (torch's generator, put back after the task; see "Seeds" in the user guide's
        "How a run works" for what trains alike to the bit).
    commit_every : int or "auto", default 1
        Commit a version every this many merges (epoch ends always commit).  ``"auto"``: every merge,
        except that results already queued behind a merge share its commit (up to 8): a merge thread
        that falls behind catches up (``benchmarks/merge_bound.py``: 6.4 -> 10.6 merges per second).
        Where commits are most of the work (a large model, short tasks), a number goes further, each
        task starting from a version up to that many merges older: for 5M parameters and 40 ms tasks
        on two cores, medians of three runs, vc-asgd 16 merges per second committing every merge, 20
        every 3 and 28 every 10; the default rule 9, 15 and 20 (stop 42).
    validate_every : int or "auto", default "auto"
        Validate every this many merges, when that merge was committed (epoch ends always).  ``"auto"``:
        when the run's validations so far (the epochs' ends included) and one more take at most a twentieth
        of the time its shard tasks took
        (a validation takes a worker's slot, as a shard does); ``1`` validates every committed merge.
    features, label, sample_dim : optional
        Variable and dimension names for xarray / Zarr data (inferred when unambiguous); for a pandas
        DataFrame, the feature columns (default: all but the label) and the label column.
    storage_options : dict, optional
        fsspec options for a Zarr URL given as ``data`` (refused, ``TypeError``, with data that would ignore
        them: a path with no scheme, an open xarray Dataset, an Icechunk session, data in memory; so is
        ``sample_dim`` with data whose samples are its first axis).
    shuffle : bool, default True
        Shuffle in-memory arrays, DataFrames and dicts of arrays once (seeded) before sharding; xarray and Zarr
        data keep their stored order (``validation=0.1`` holds out their last rows).
    keep_updates : bool, default False
        Keep every client update (``history["update"]`` gives its path under ``<store>/runs``)
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
    optimizer_state : {"auto", "fresh", "worker"}, default "auto"
        ``"fresh"``: a new optimizer for every shard task (the paper).  ``"worker"``: each worker keeps
        its optimizer state (e.g. Adam's moments) between its tasks of this run.  ``"auto"``: ``"worker"``
        when a task takes at least as many local steps as the optimizer's first moment remembers
        (``1 / (1 - beta1)``, 10 for Adam), else ``"fresh"``; decided when the run starts, and logged
        (see :mod:`vcdask.inner`).  Kept state reached a target accuracy sooner on digits and the wide
        CNN (12 Adam steps at 1e-3 per task).  The char-LM (AdamW at 5e-3) did worse with it at every task
        length measured (2, 8 and 16 steps): "auto" picks "fresh" for its 2-step tasks, but pass
        ``"fresh"`` for a high inner learning rate with longer tasks.
    lr_schedule : callable or vcdask.lr_schedules.RunSchedule, optional
        Scales the learning rate at every local step.  A schedule of :mod:`vcdask.lr_schedules`
        (``Cosine(warmup=0.05)``, ``Linear``, ``Constant``, ``OverRun(fn(step, total))``) is indexed by
        the run's global count of local steps, in the order the run handed out its shards, as plain
        torch's scheduler is over the same data; ``lr_schedule(epoch, step) -> factor`` by the run's
        epoch (from 1) and the step within the task (from 0).
    clip_grad_norm : float, optional
        Clip the gradients' total norm to this before every local step.
    compression : {None, "fp16", "bf16", "int8", "int4"}, optional
        Send each update as its difference from the version it trained from, in fewer bits
        (``"int8"``: about a quarter of the bytes), with error feedback on the worker (see
        :mod:`vcdask.compress`).  Default: the full float32 ``W_c``.
    patience : int, optional
        Early stopping: stop once the ``monitor`` metric of the validation data has not improved
        for this many epochs (``FitResult.stop_reason`` says so).  Without ``validation``, 10% of
        the data is held out.  The result's ``model`` and ``version`` are the last version;
        ``FitResult.best_version`` is the end of the best epoch.
    monitor : str, optional
        The validation metric early stopping and ``FitResult.best_version`` follow; default the
        ``target``'s metric, else the first of ``metrics`` (``"accuracy"`` / ``"mae"`` by default).
        Names that say lower is better improve downwards (ending in loss, error, mse, mae, perplexity, nll,
        wer ...; a ``functools.partial``'s by its function's name, ``"scaled_error(scale=2.0)"``:
        :func:`vcdask.engine.policy.lower_is_better`), others upwards; one whose direction vcdask does not know
        is warned of when ``monitor`` names it or ``patience`` follows it.  Needs validation data
        (``validation=``) unless ``patience`` or a ``target`` is given (10% is held out then).
    wait : bool, default True
        False: return the run's :class:`~vcdask.RunHandle` as soon as the data is staged and the
        initial version committed, before the first merge.  It behaves like a future:
        ``handle.result(timeout=None)`` gives this ``FitResult`` (with ``model`` loaded),
        ``done()``, ``cancel()``, ``status()``, ``panel()``, ``await handle``.  No progress bar is
        shown (call ``handle.panel()`` in a notebook).  The embedded cluster outlives the call.
        With ``client=`` a cluster object, the handle owns the client opened for it: it closes it once
        the result is collected or the run cancelled, or on ``handle.close()`` / a ``with`` block.
    speed_adaptive : bool, default False
        Size each task to its worker's measured speed: a worker slower than the fastest one trains
        that share of its shard's batches (at least a tenth), so its task takes about as long as a
        fast worker's and its update is no staler (``history.fraction``).  A slow worker then trains
        fewer samples in an epoch.
    merging : Merging, optional
        How updates merge, as one group: :class:`vcdask.Merging` (``rule``, ``alpha``, ``commit_every``,
        ``compression``, ``tasks_per_slot``, ``speed_adaptive``), the options above of the same names
        (``rule`` is ``merge``).  Every option can be given flat or in its group; a flat one at its
        default leaves the group's value, and one set both ways is a ``TypeError`` naming both.
    training : Training, optional
        How each shard task trains, as one group: :class:`vcdask.Training` (``optimizer``, ``lr``,
        ``lr_schedule``, ``clip_grad_norm``, ``precision``, ``optimizer_state``, ``local_epochs``,
        ``batch_size``, ``device``).
    stopping : Stopping, optional
        When the run stops early and how often it validates, as one group: :class:`vcdask.Stopping`
        (``target``, ``patience``, ``monitor``, ``validate_every``).

    Returns
    -------
    FitResult, or RunHandle with ``wait=False``

    Raises
    ------
    ValueError, TypeError
        Bad arguments, before any cluster work; messages name the value and the valid choices.  An
        option given both flat and in its group (``lr=0.1, training=Training(lr=0.01)``): ``TypeError``.
    MainGuardError
        The embedded cluster would be started from a script's top level without
        ``if __name__ == "__main__":``.
    RunFailedError
        The run failed on the cluster.

    Examples
    --------
    >>> result = vcdask.fit(model, (X, y), validation=0.2, patience=3)          # doctest: +SKIP
    >>> handle = vcdask.fit(model, (X, y), max_epochs=20, wait=False)           # doctest: +SKIP
    >>> handle.status()["epochs_done"]                                          # doctest: +SKIP
    >>> result = handle.result()                                                # doctest: +SKIP
    >>> result = vcdask.fit(model, (X, y), merging=vcdask.Merging(rule="staleness", alpha=0.5),
    ...                     stopping=vcdask.Stopping(target={"accuracy": 0.9}))  # doctest: +SKIP
    """
    if extra:
        raise TypeError(
            f"fit() takes the training data as one argument, got {1 + len(extra)} after the model: pass "
            "fit(model, (X, y)) with X and y as one tuple (not scikit-learn's fit(X, y)), or a DataFrame "
            "with label='column'; every other option by keyword"
        )
    merging = fold(
        Merging,
        merging,
        merge=merge,
        alpha=alpha,
        commit_every=commit_every,
        compression=compression,
        tasks_per_slot=tasks_per_slot,
        speed_adaptive=speed_adaptive,
    )
    training = fold(
        Training,
        training,
        optimizer=optimizer,
        lr=lr,
        lr_schedule=lr_schedule,
        clip_grad_norm=clip_grad_norm,
        precision=precision,
        optimizer_state=optimizer_state,
        local_epochs=local_epochs,
        batch_size=batch_size,
        device=device,
    )
    stopping = fold(
        Stopping, stopping, target=target, patience=patience, monitor=monitor, validate_every=validate_every
    )
    wait, progress = check_bool("wait", wait), check_bool("progress", progress)
    checked = plan(
        model,
        data,
        merging=merging,
        training=training,
        stopping=stopping,
        resilience=resilience,
        retention=retention,
        loss=loss,
        metrics=metrics,
        train_step=train_step,
        eval_step=eval_step,
        collate_fn=collate_fn,
        validation=validation,
        max_epochs=max_epochs,
        n_shards=n_shards,
        client=client,
        store=store,
        seed=seed,
        features=features,
        label=label,
        sample_dim=sample_dim,
        storage_options=storage_options,
        shuffle=shuffle,
        keep_updates=keep_updates,
    )
    return launch(checked, client, model, wait=wait, progress=progress)
