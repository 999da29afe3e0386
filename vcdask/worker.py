"""What a Dask worker runs: train one shard from a server version, or validate a version.

Both read everything big from the parameter store (the run spec, the server version,
their rows of data) and cache it per worker process; they return small records only.
A shard task reads like a plain training loop: spec and rows, the newest version on this
worker's device, an optimizer, ``local_epochs`` passes of ``train_step``, upload ``W_c``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import statistics
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from . import _held, config, overlap
from . import batches as _batches
from ._seeds import derived_seeds, task_rng
from ._worker_spec import run_spec
from .compress import EncodedUpdate, encode
from .cost import instance_here
from .device import describe, resolve_device
from .errors import ParameterMismatchError
from .inner import InnerOptimizer
from .params import FlatParams, all_finite, flatten, state_tensors
from .spec import RunSpec, cached_spec
from .steps import SupervisedStep, evaluate, train_mode
from .updates import update_path, write_update

logger = logging.getLogger(__name__)

__all__ = ["train_shard", "validate_version"]


def _warm_rows(store, run_id: str, shard: int) -> _batches.Rows | None:
    """The shard's rows, if this process has them and the run's spec at hand (None: nothing is read)."""
    spec = cached_spec(store, run_id)
    if spec is None:
        return None
    try:
        pin = resolve_device(spec.device).type == "cuda"
    except RuntimeError:  # (the task fails on it below, once it has said it started)
        return None
    return _batches.cached_rows(spec, spec.train, *spec.shards.bounds(shard), pin=pin)


def _dask_worker() -> Any:
    """The Dask worker running this task; None when called directly, off a worker."""
    from distributed import get_worker

    try:
        return get_worker()
    except ValueError:
        return None


def _tell_run(handler: str, run_id: str, *, dask_worker: Any = None, key: str | None = None, **extra: Any) -> Any:
    """Call the run's scheduler handler ``handler`` about the task running here (or task ``key`` of
    ``dask_worker``, from another thread); return its answer (None off a Dask worker: called directly)."""
    worker = dask_worker or _dask_worker()
    if worker is None:
        return None
    from distributed.utils import sync

    key = key if key is not None else worker.get_current_task()
    return sync(worker.loop, getattr(worker.scheduler, handler), run_id=run_id, key=key, worker=worker.address, **extra)


def _tell_run_later(handler: str, run_id: str, **extra: Any) -> concurrent.futures.Future | None:
    """:func:`_tell_run` without waiting: the answer's future (None off a Dask worker)."""
    worker = _dask_worker()
    if worker is None:
        return None
    call = getattr(worker.scheduler, handler)(
        run_id=run_id, key=worker.get_current_task(), worker=worker.address, **extra
    )
    return asyncio.run_coroutine_threadsafe(call, worker.loop.asyncio_loop)


_lock = threading.Lock()
#: Bases that hand-overs' answers gave for the shard copies to run next here: key -> (base, seconds waited)
_next_bases: OrderedDict[str, tuple[dict[str, Any], float]] = OrderedDict()
_MAX_NEXT_BASES = 8
#: run id -> the share of its shard's batches the run last gave this worker (``speed_adaptive``; dropped as
#: the run ends, with what else the worker keeps for it: :func:`vcdask._held.release_run`)
_fractions = _held.fractions


def _hand_over(run_id: str, record: dict[str, Any], own: FlatParams | None = None) -> None:
    """Send the task's record to the run as the task finishes.

    The run gets it a round trip sooner than from Dask (which reports the task done, after which the
    run fetches the result from this worker), and sends this worker its next shard at once.  Best
    effort: the record is also the task's result, which the run reads as before if this fails.

    With ``vcdask.worker.next-base``, a shard task also takes the answer's base for the copy the run
    sent here to run next, once the run has merged this update (the copy then asks for nothing when
    it starts: one message to the scheduler per task instead of two).

    ``own``: the task's ``W_c`` on its device, with ``vcdask.worker.overlap="delta"``: the hand-over
    does not wait for the answer, and this process's next task of the run trains from ``own`` meanwhile
    (:mod:`vcdask.overlap`).
    """
    if not config.get("worker.hand-over"):
        return
    if own is not None:
        answer = _tell_run_later("vcdask_finished", run_id, record=record, next_base=config.get("worker.next-base"))
        if answer is not None:
            overlap.put(overlap.Pending(run_id, answer, own, _fractions.get(run_id, 1.0)))
        return
    ask = record.get("kind") == "update" and bool(config.get("worker.next-base"))
    t0 = time.perf_counter()
    try:
        answer = _tell_run("vcdask_finished", run_id, record=record, next_base=ask)
    except Exception as e:  # noqa: BLE001 - the result still travels the usual way
        logger.debug("could not hand the record of a %s task to run %s: %r", record.get("kind"), run_id, e)
        return
    nxt = answer.get("next") if isinstance(answer, dict) else None
    if nxt:
        with _lock:
            _next_bases[nxt.pop("key")] = (nxt, time.perf_counter() - t0)
            while len(_next_bases) > _MAX_NEXT_BASES:  # copies Dask ran elsewhere
                _next_bases.popitem(last=False)


def _handed_base() -> tuple[dict[str, Any], float] | None:
    """The base a hand-over's answer gave for the task running here, and the seconds it waited for it."""
    worker = _dask_worker()
    if worker is None:
        return None
    key = worker.get_current_task()
    with _lock:
        return _next_bases.pop(str(key), None)


def _worker_address() -> str:
    worker = _dask_worker()
    return "local" if worker is None else worker.address


def train_shard(
    store,
    run_id: str,
    epoch: int,
    shard: int,
    attempt: int,
    base_version: str | None,
    base_step: int,
    position: int | None = None,
) -> dict[str, Any]:
    """Train one shard for ``local_epochs`` from the run's newest version; upload ``W_c``.

    ``base_version`` / ``base_step`` is the version the run had when it dispatched this copy.  The
    task first reads what it needs (the spec, its rows: slow on a cold worker), then asks the run for
    its newest version and trains from that, so time spent queued or warming up is not counted as
    staleness.  A small model's base comes with the run's answer (no store read); one given as it was
    merged, before its commit, has no version id yet: the record's ``base_version`` is then None, and
    ``base_step`` the step whose version it becomes.  ``position`` is the shard's place in the order
    the run handed out its shards (a :mod:`vcdask.lr_schedules` schedule's clock).

    Returns
    -------
    dict
        A small record for the scheduler plugin: where the update is, its base, loss, timing, worker;
        or, for a copy the run no longer waits for when it asks for its base, ``kind="abandoned"``
        (nothing trained, nothing written).
    """
    t0 = time.perf_counter()
    # with the spec and the rows at hand (a warm worker), the task is ready at once: the run learns that it
    # started from its request for a base, one message instead of two
    warm = _warm_rows(store, run_id, shard)
    # the last task's hand-over may have brought this one's base (the run then counts it started already);
    # with overlap="delta", that hand-over may still be out: this task trains from its W_c meanwhile
    handed = _handed_base()
    pending = overlap.take(run_id) if handed is None else None
    if warm is None and handed is None and pending is None:
        _tell_run("vcdask_started", run_id, **instance_here())  # its deadline counts from here; what it costs
    elif handed is not None:  # the hand-over counted it started; it may have waited here behind other
        _tell_run_later("vcdask_started", run_id, **instance_here())  # work: it begins now (no answer awaited)
    spec = run_spec(store, run_id, _worker_address)
    device, precision = _held.setup(spec)
    start, stop = spec.shards.bounds(shard)
    rows = warm if warm is not None else _batches.rows(spec, spec.train, start, stop, pin=device.type == "cuda")
    if warm is None:
        _held.warm_torch(device)
    t_base = time.perf_counter()
    given = None  # a small model's base came with the answer: no store read
    newest: dict[str, Any] | None
    if pending is not None:  # the base comes while this task trains: from the worker's own W_c until then
        # (a round trip, answered at once: its deadline counts from here, and a worker that dies from now
        # on is charged to this copy, as it must be when the copy's own data kills it)
        _tell_run("vcdask_started", run_id, **instance_here())
        worker = _dask_worker()
        pending.resolve(_base_fetcher(store, worker, str(worker.get_current_task())))
        newest, wait, given = {"fraction": pending.fraction}, 0.0, pending.own
    elif handed is not None and warm is not None:
        newest, wait = handed  # the history's wait_seconds: the hand-over's, which waited for the merge
    else:  # ready to train: from the newest version
        says_started = warm is not None and handed is None
        newest = _tell_run("vcdask_base", run_id, started=instance_here() if says_started else None)
        wait = time.perf_counter() - t_base
    if newest is not None and newest.get("abandon"):  # the run no longer waits for this copy
        return _abandoned(run_id, epoch, shard, attempt)
    if (
        pending is None
        and newest is not None
        and (newest.get("version") is not None or newest.get("params") is not None)
    ):
        # (no version id: parameters merged and being committed as the version of that step)
        base_version, base_step = newest.get("version"), int(newest["step"])
        if newest.get("params") is not None:
            given = _held.brought(base_version, newest["params"])
    # speed_adaptive: a slow worker trains the share of its shard's batches the run gives it
    fraction = float(newest.get("fraction", 1.0)) if newest is not None else 1.0
    _fractions[run_id] = fraction
    per_pass = -(-_batches.n_rows(rows) // spec.batch_size)
    limit = None if fraction >= 1.0 else max(1, math.ceil(fraction * per_pass))
    model = _held.loaded_model(spec, store, base_version, device, given)
    t_read = time.perf_counter()
    inner = InnerOptimizer(spec, model, precision, epoch, position)  # fresh, or this worker's kept state
    train_step = spec.train_step or SupervisedStep(_held.loss_on(spec, device))  # (a loss module: on the device)
    # the batch order, and the model's own draws (dropout): from (seed, epoch, shard, attempt) (vcdask._seeds)
    order_seed, torch_seed = derived_seeds(spec.seed, epoch, shard, attempt)
    g = torch.Generator().manual_seed(order_seed)
    with task_rng(torch_seed, device):
        train_mode(model, spec.eval_modules)  # (the layers the user froze, a batch norm's statistics, stay frozen)
        ahead = 0  # steps trained from the worker's own W_c before the merged version came (overlap="delta")
        # (at most this many: then the task waits for it, so most of its steps are taken from the merged version)
        most_ahead = overlap.most_ahead(spec.local_epochs * (per_pass if limit is None else limit))
        losses: list[torch.Tensor] = []
        stamps = [time.perf_counter()]
        rows = _batches.on_device(rows, device)  # (once for all local epochs, where batches are cut on the device)
        for _ in range(spec.local_epochs):
            for batch, _n in _batches.batches(spec, rows, device, spec.batch_size, generator=g, limit=limit):
                if pending is not None and (pending.ready() or len(losses) >= most_ahead):  # train on from the merge
                    t_wait = time.perf_counter()
                    if (base := _corrected(model, pending)) is None:
                        return _abandoned(run_id, epoch, shard, attempt)
                    (base_version, base_step), pending, ahead = base, None, len(losses)
                    wait = time.perf_counter() - t_wait
                with precision.autocast():
                    loss = train_step(model, batch)
                inner.step(loss)
                losses.append(loss.detach())
                stamps.append(time.perf_counter())
        del rows  # (a GPU shard's copy goes now, not after the upload)
        if pending is not None:  # trained before the merge came: wait for it (the only wait of such a task)
            t_wait = time.perf_counter()
            if (base := _corrected(model, pending)) is None:
                return _abandoned(run_id, epoch, shard, attempt)
            (base_version, base_step), wait, ahead = base, time.perf_counter() - t_wait, len(losses)
    train_loss = float(torch.stack(losses).float().mean()) if losses else float("nan")
    first_loss = float(losses[0]) if losses else float("nan")  # at the task's base (vcdask.diagnose)
    inner.done(finite=math.isfinite(train_loss))

    t_train = time.perf_counter()
    path = update_path(run_id, epoch, shard, attempt)
    record = {
        "kind": "update",
        "run_id": run_id,
        "epoch": epoch,
        "shard": shard,
        "attempt": attempt,
        "base_version": base_version,
        "base_step": base_step,
        "update": path,
        "n_samples": stop - start,
        "train_loss": train_loss,
        "first_loss": first_loss,
        "read_seconds": t_read - t0,
        "wait_seconds": wait,
        "train_seconds": t_train - t_read,
        "worker": _worker_address(),
        "device": describe(device),
        **instance_here(),  # for the run's cost accounting
        "steps": inner.step_count,
        "fraction": 1.0 if limit is None else limit / per_pass,
        "steps_ahead": ahead,
        # this worker's pace: the median step (a task's first steps also pay warm-up and allocation)
        "step_seconds": statistics.median(b - a for a, b in itertools.pairwise(stamps)) if len(stamps) > 1 else None,
    }
    # the record travels with the update, so a resumed run can merge an upload nobody reported
    update: FlatParams | EncodedUpdate | torch.nn.Module
    if spec.compression is not None:  # W_c - W_base in fewer bits, with error feedback
        if base_version is None:  # (the run gives no draft base to a run with compression)
            raise RuntimeError(f"shard {shard}: a compressed update needs the version id of its base")
        update = encode(
            spec.compression,
            _held.to_cpu(model, device),
            _held.version_params(store, base_version),
            base_version,
            run_id,
        )
    else:  # a CPU model's tensors are written as they are (no packed copy); a GPU's are packed there, copied once
        update = model if device.type == "cpu" else _held.to_cpu(model, device)
    record["nbytes"] = write_update(store.files, path, update, meta=record)
    t_end = time.perf_counter()
    record.update(seconds=t_end - t0, upload_seconds=t_end - t_train)
    delta = spec.overlap == "delta" and _dask_worker() is not None and config.get("worker.hand-over")
    own = flatten(model, device=device) if delta else None
    if own is not None and (_reshaped(own, spec) or not _finite(own)):
        own = None  # (its update will be rejected): the next task starts as usual, from the run's version
    _hand_over(run_id, record, own=own)
    return record


def _finite(params: FlatParams) -> bool:
    """Whether every floating value of ``params`` is finite (one sum per dtype, on their device): a next
    task started ahead from a NaN ``W_c`` would stay NaN through its correction, and be rejected too."""
    return all(all_finite(a) for a in params.arrays.values() if a.is_floating_point())


def _reshaped(params: FlatParams, spec: RunSpec) -> bool:
    """Whether ``params`` are laid out otherwise than the run's model (user code reshaped its copy)."""
    problems = params.layout.diff(state_tensors(spec.model)[0])
    return bool(problems) and problems != ["same entries in a different order"]


def _abandoned(run_id: str, epoch: int, shard: int, attempt: int) -> dict[str, Any]:
    """The record of a copy the run no longer waits for: nothing trained is written."""
    return {"kind": "abandoned", "run_id": run_id, "epoch": epoch, "shard": shard, "attempt": attempt}


def _base_fetcher(store, dask_worker: Any, key: str):
    """What fetches a delta task's base in a thread (:meth:`vcdask.overlap.Pending.resolve`): the answer
    to the hand-over of the update before it, or, when that answer gives no base for task ``key``, the
    run's answer to the task's own request; then the base's parameters (brought, cached or read)."""

    def fetch(pending: overlap.Pending) -> overlap.Base:
        try:
            answer = pending.answer.result()
        except Exception as e:  # noqa: BLE001 - the record still reached the run through Dask
            logger.debug("hand-over of run %s failed: %r; asking for the base", pending.run_id, e)
            answer = None
        nxt = answer.get("next") if isinstance(answer, dict) else None
        if nxt is not None and nxt.pop("key", None) == key:
            base = nxt
        else:  # another copy ran here first, or the run did not answer with a base: ask for this task's
            base = _tell_run("vcdask_base", pending.run_id, dask_worker=dask_worker, key=key)
        if not base or base.get("abandon"):
            return overlap.Base(None)
        if "fraction" in base:
            _fractions[pending.run_id] = float(base["fraction"])
        if base.get("params") is not None:
            return overlap.Base(base, _held.brought(base.get("version"), base["params"]))
        return overlap.Base(base, _held.version_params(store, base["version"]))

    return fetch


def _corrected(model: torch.nn.Module, pending: overlap.Pending) -> tuple[str | None, int] | None:
    """Correct ``model`` by the merged version of the update before it (:func:`vcdask.overlap.correct`);
    that version's id and step, now the task's base (None: the run no longer waits for the task)."""
    base = pending.result()
    if base.answer is None or base.params is None:
        return None
    try:
        overlap.correct(model, base.params, pending.own)
    except ParameterMismatchError as e:  # user code reshaped the model meanwhile: its update will be rejected
        logger.debug("no correction: %s", e)
    return base.answer.get("version"), int(base.answer["step"])


def validate_version(store, run_id: str, version: str, step: int) -> dict[str, Any]:
    """Validation loss and metrics of one server version."""
    t0 = time.perf_counter()
    with _lock:  # the base a hand-over gave for the next shard here is older by this validation: ask again
        _next_bases.clear()
    _tell_run("vcdask_started", run_id, **instance_here())  # its deadline counts from here
    spec = run_spec(store, run_id, _worker_address)
    device, precision = _held.setup(spec)
    model = _held.loaded_model(spec, store, version, device)
    rows = _batches.rows(spec, spec.validation, 0, spec.validation.n, pin=device.type == "cuda")
    metrics = evaluate(spec, model, _batches.batches(spec, rows, device, max(spec.batch_size, 512)), precision)
    record = {
        "kind": "validation",
        "run_id": run_id,
        "version": version,
        "step": step,
        "metrics": metrics,
        "seconds": time.perf_counter() - t0,
        "worker": _worker_address(),
        "device": describe(device),
    }
    _hand_over(run_id, record)
    return record
