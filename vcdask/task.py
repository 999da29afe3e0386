"""What a Dask worker runs: train one shard from a server version, or validate a version.

Both read everything big from the parameter store (the run spec, the server version,
their rows of data) and cache it per worker process; they return small records only.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import ParameterMismatchError, StoreError
from .params import FlatParams, flatten, load_into
from .updates import update_path, write_update

logger = logging.getLogger(__name__)

__all__ = ["RunSpec", "train_shard", "validate_version"]


@dataclass(frozen=True)
class RunSpec:
    """Everything about a run that workers and the scheduler plugin need; stored once per run."""

    run_id: str
    store: Any  # ParamStore (pickles as its location)
    branch: str
    model: torch.nn.Module  # architecture + initial weights (a template; workers copy it)
    loss: Any
    optimizer: Any  # callable(params) -> torch.optim.Optimizer
    local_epochs: int
    batch_size: int
    seed: int
    train: Any  # DataSource
    shards: Any  # Shards
    validation: Any  # DataSource or None
    metrics: dict[str, Any]
    classification: bool
    x_dtype: torch.dtype
    max_epochs: int
    merge: Any  # vcdask.rules.MergeRule
    target: dict[str, float] | None
    commit_every: int
    validate_every: int
    keep_updates: bool = False
    tasks_per_slot: int = 2
    resilience: Any = None  # vcdask.Resilience
    torch_threads: int = 1
    started_at: float = field(default_factory=time.time)

    @property
    def spec_path(self) -> str:
        return f"{self.run_id}/spec.pkl"


# -- per-process caches -------------------------------------------------------------------
_lock = threading.Lock()
_specs: dict[tuple[str, str], RunSpec] = {}
_versions: OrderedDict[str, FlatParams] = OrderedDict()
_rows: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_models = threading.local()
_MAX_VERSIONS = 4
_MAX_ROW_BYTES = 2 << 30


def load_spec(store, run_id: str) -> RunSpec:
    """The run's spec, read from the store once per process."""
    import cloudpickle

    key = (store.location, run_id)
    with _lock:
        spec = _specs.get(key)
    if spec is None:
        spec = cloudpickle.loads(store.files.get(f"{run_id}/spec.pkl"))
        with _lock:
            _specs[key] = spec
    return spec


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


def cached_shards(run_id: str) -> int:
    """How many row blocks this process holds (for tests and the worker table)."""
    with _lock:
        return len(_rows)


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


def _notify_started(run_id: str) -> None:
    """Tell the run this task has started (deadlines count from here, not from dispatch)."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        return  # not on a Dask worker (called directly)
    from distributed.utils import sync

    sync(worker.loop, worker.scheduler.vcdask_started, run_id=run_id, key=worker.get_current_task(),
         worker=worker.address)


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:
        return "local"


def train_shard(store, run_id: str, epoch: int, shard: int, attempt: int, base_version: str,
                base_step: int) -> dict[str, Any]:
    """Train one shard for ``local_epochs`` from server version ``base_version``; upload ``W_c``.

    Returns
    -------
    dict
        A small record for the scheduler plugin: where the update is, loss, timing, worker.
    """
    t0 = time.perf_counter()
    _notify_started(run_id)
    spec = load_spec(store, run_id)
    torch.set_num_threads(spec.torch_threads)
    model = _loaded_model(spec, store, base_version)
    start, stop = spec.shards.bounds(shard)
    X, y = _data(spec, spec.train, start, stop)
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
        "kind": "update", "run_id": run_id, "epoch": epoch, "shard": shard, "attempt": attempt,
        "base_version": base_version, "base_step": base_step, "update": path,
        "n_samples": stop - start, "train_loss": float(np.mean(losses)) if losses else float("nan"),
        "read_seconds": t_read - t0, "train_seconds": t_train - t_read, "worker": _worker_address(),
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
    return {"kind": "validation", "run_id": run_id, "version": version, "step": step, "metrics": metrics,
            "seconds": time.perf_counter() - t0, "worker": _worker_address()}
