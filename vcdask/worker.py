"""What a Dask worker runs: train one shard from a server version, or validate a version.

Both read everything big from the parameter store (the run spec, the server version,
their rows of data) and cache it per worker process; they return small records only.
A shard task reads like a plain training loop: spec and rows, the newest version, a fresh
optimizer, ``local_epochs`` passes, upload ``W_c``.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from .errors import ParameterMismatchError, StoreError
from .params import FlatParams, flatten, load_into
from .spec import RunSpec, load_spec
from .updates import update_path, write_update

logger = logging.getLogger(__name__)

__all__ = ["evaluate", "train_shard", "validate_version"]


# -- per-process caches -------------------------------------------------------------------
_lock = threading.Lock()
_versions: OrderedDict[str, FlatParams] = OrderedDict()
_rows: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_models = threading.local()
_MAX_VERSIONS = 4
_MAX_ROW_BYTES = 2 << 30


def _version(store, version: str) -> FlatParams:
    with _lock:
        params = _versions.get(version)
        if params is not None:
            _versions.move_to_end(version)
            return params
    params = store.read(version).params
    with _lock:
        _versions[version] = params
        while len(_versions) > _MAX_VERSIONS:
            _versions.popitem(last=False)
    return params


def _data(spec: RunSpec, source, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [start, stop) of ``source`` as tensors, cached (the paper's "sticky files")."""
    key = (source.url, id(source.zarr_store) if source.zarr_store is not None else None, source.offset, start, stop)
    with _lock:
        hit = _rows.get(key)
        if hit is not None:
            _rows.move_to_end(key)
            return hit
    try:
        X, y = source.read(start, stop)
    except (FileNotFoundError, PermissionError):
        raise  # not transient: the data is not there, or not for us
    except OSError as e:  # the storage holding the data failed (e.g. a 503): a store fault, not the worker's
        raise StoreError(f"reading rows {start}:{stop} of {source.url or 'the data'}: {e}") from e
    Xt = torch.as_tensor(np.ascontiguousarray(X)).to(spec.x_dtype)
    yt = torch.as_tensor(np.ascontiguousarray(y))
    yt = yt.long() if spec.classification else yt.to(spec.x_dtype)
    with _lock:
        _rows[key] = (Xt, yt)
        while sum(a.nbytes + b.nbytes for a, b in _rows.values()) > _MAX_ROW_BYTES and len(_rows) > 1:
            _rows.popitem(last=False)
    return Xt, yt


def _model(spec: RunSpec) -> torch.nn.Module:
    """A private copy of the run's model for this thread (threads never share a module)."""
    models = getattr(_models, "by_run", None)
    if models is None:
        models = _models.by_run = {}
    model = models.get(spec.run_id)
    if model is None:
        model = models[spec.run_id] = copy.deepcopy(spec.model)
    return model


def _loaded_model(spec: RunSpec, store, version: str) -> torch.nn.Module:
    """This thread's copy of the model holding ``version``."""
    model = _model(spec)
    try:
        load_into(model, _version(store, version))
    except ParameterMismatchError:  # user code reshaped this copy last time: start afresh
        _models.by_run[spec.run_id] = model = copy.deepcopy(spec.model)
        load_into(model, _version(store, version))
    return model


def _tell_run(handler: str, run_id: str) -> dict[str, Any] | None:
    """Call the run's scheduler handler ``handler`` about the task running here; return its answer
    (None off a Dask worker: called directly)."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        return None
    from distributed.utils import sync

    return sync(
        worker.loop,
        getattr(worker.scheduler, handler),
        run_id=run_id,
        key=worker.get_current_task(),
        worker=worker.address,
    )


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:
        return "local"


def train_shard(
    store, run_id: str, epoch: int, shard: int, attempt: int, base_version: str, base_step: int
) -> dict[str, Any]:
    """Train one shard for ``local_epochs`` from the run's newest version; upload ``W_c``.

    ``base_version`` / ``base_step`` is the version the run had when it dispatched this copy.  The
    task first reads what it needs (the spec, its rows: slow on a cold worker), then asks the run for
    its newest version and trains from that, so time spent queued or warming up is not counted as
    staleness.

    Returns
    -------
    dict
        A small record for the scheduler plugin: where the update is, its base, loss, timing, worker.
    """
    t0 = time.perf_counter()
    _tell_run("vcdask_started", run_id)  # its deadline counts from here
    spec = load_spec(store, run_id)
    torch.set_num_threads(spec.torch_threads)
    start, stop = spec.shards.bounds(shard)
    X, y = _data(spec, spec.train, start, stop)
    newest = _tell_run("vcdask_base", run_id)  # ready to train: from the newest version
    if newest is not None and newest.get("version") is not None:
        base_version, base_step = newest["version"], int(newest["step"])
    model = _loaded_model(spec, store, base_version)
    t_read = time.perf_counter()
    optimizer = spec.optimizer(model.parameters())  # fresh optimizer state for every shard
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + epoch * 10_007 + shard * 101 + attempt)

    model.train()
    losses = []
    for _ in range(spec.local_epochs):
        order = torch.randperm(len(X), generator=g)
        for i in range(0, len(X), spec.batch_size):
            idx = order[i : i + spec.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = spec.loss(model(X[idx]), y[idx])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())

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
        "train_loss": float(np.mean(losses)) if losses else float("nan"),
        "read_seconds": t_read - t0,
        "train_seconds": t_train - t_read,
        "worker": _worker_address(),
    }
    # the record travels with the update, so a resumed run can merge an upload nobody reported
    record["nbytes"] = write_update(store.files, path, flatten(model), meta=record)
    t_end = time.perf_counter()
    record.update(seconds=t_end - t0, upload_seconds=t_end - t_train)
    return record


def evaluate(spec: RunSpec, model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Loss and metrics of ``model`` on ``(X, y)``, in batches, without gradients."""
    model.eval()
    outs = []
    with torch.no_grad():
        for i in range(0, len(X), 1024):
            outs.append(model(X[i : i + 1024]))
    out = torch.cat(outs) if outs else torch.empty(0)
    result = {"loss": float(spec.loss(out, y))}
    for name, fn in spec.metrics.items():
        result[name] = float(fn(out, y))
    return result


def validate_version(store, run_id: str, version: str, step: int) -> dict[str, Any]:
    """Validation loss and metrics of one server version."""
    t0 = time.perf_counter()
    spec = load_spec(store, run_id)
    torch.set_num_threads(spec.torch_threads)
    model = _loaded_model(spec, store, version)
    X, y = _data(spec, spec.validation, 0, spec.validation.n)
    metrics = evaluate(spec, model, X, y)
    return {
        "kind": "validation",
        "run_id": run_id,
        "version": version,
        "step": step,
        "metrics": metrics,
        "seconds": time.perf_counter() - t0,
        "worker": _worker_address(),
    }
