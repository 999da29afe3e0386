"""The run specification: everything about a run that workers and the scheduler plugin need.

Written once per run to ``<store>/runs/<run_id>/spec.pkl`` (cloudpickle) and read once per
process.  It holds no secret: the store inside pickles as its location and non-secret options.  A spec read
from a store is bound to that store (:func:`bind`): a store copied or moved elsewhere trains, records and
resumes there, never where its specs were written.
"""

from __future__ import annotations

import copy
import io
import pickle
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from .store._runs import record_path

__all__ = [
    "MOVED_MODULES",
    "RunSpec",
    "bind",
    "forget",
    "load_spec",
    "loads",
    "record_path",
    "save_spec",
    "spec_path",
]


def spec_path(run_id: str) -> str:
    """Where a run's spec lives, relative to ``<store>/runs``."""
    return f"{run_id}/spec.pkl"


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
    merge: Any  # vcdask.merge.MergeRule
    target: dict[str, float] | None
    commit_every: int
    validate_every: int | str  # or "auto" (engine.policy.validation_due)
    keep_updates: bool = False
    tasks_per_slot: int = 1
    resilience: Any = None  # vcdask.Resilience
    torch_threads: int = 1
    started_at: float = field(default_factory=time.time)
    # added with devices and custom steps (class-level defaults: specs written before still load)
    device: str = "auto"  # each worker resolves it (vcdask.device.resolve_device)
    precision: str = "32"
    train_step: Any = None  # fn(model, batch) -> loss; None: loss(model(x), y)
    eval_step: Any = None  # fn(model, batch) -> {name: value}
    metric_names: tuple[str, ...] = ()  # what validation reports besides the default step's loss and metrics
    batch_form: str = "xy"  # "xy", "dict" or "dataset"
    cast_x: bool = True  # (X, y) data: X takes the model's dtype (False: integer inputs such as tokens stay integer)
    optimizer_state: str = "fresh"  # or "worker"; runs written before the option resume as they trained (fresh)
    lr_schedule: Any = None  # fn(epoch, step) -> factor
    clip_grad_norm: float | None = None
    retention: Any = None  # vcdask.Retention; None: keep every version (and in specs written before retention)
    compression: str | None = None  # vcdask.compress codec of the updates; None: full W_c
    speed_adaptive: bool = False  # a slow worker's task trains a share of its shard (engine.policy.work_fraction)
    prices: dict[str, dict[str, float]] | None = None  # vcdask.cost: $/h per instance type and market
    feature_names: tuple = ()  # X's columns by name, in its order (FitResult.predict selects them): pandas, xarray data
    patience: int | None = None  # early stopping: epochs without improvement of `monitor`
    monitor: str | None = None  # the validation metric early stopping (and FitResult.best_version) follows
    start: dict[str, Any] | None = None  # where the model came from: {"version", "tag", "store"} or None
    overlap: str = "wait"  # vcdask.overlap: how a worker's next shard meets its last merge (runs before it: wait)
    merge_in_flight: int | None = None  # fit's default rule: the tasks in flight it is for (None: the user's rule)
    label_shape: tuple[int, ...] | None = None  # a sample's label (vcdask.metrics.label_shape): predict's class axis
    eval_modules: tuple[str, ...] = ()  # frozen submodules in eval mode, trained so (steps.eval_modules): topmost
    label_range: tuple[int, int] | None = None  # integer labels' (min, max): predict reads class ids up to max only

    @property
    def spec_path(self) -> str:
        return spec_path(self.run_id)


_lock = threading.Lock()
_specs: OrderedDict[tuple[str, str], RunSpec] = OrderedDict()
#: Specs kept per process (a spec holds the run's model): the runs a worker trains lately.
_MAX_SPECS = 4


def _remember(key: tuple[str, str], spec: RunSpec) -> None:
    with _lock:
        _specs[key] = spec
        _specs.move_to_end(key)
        while len(_specs) > _MAX_SPECS:
            _specs.popitem(last=False)


def forget(run_id: str) -> int:
    """Drop this process's cached specs of run ``run_id`` (the run ended, or resumes with a spec of its own,
    e.g. ``resume(max_epochs=)``: a worker reads it again); how many there were."""
    with _lock:
        keys = [key for key in _specs if key[1] == run_id]
        for key in keys:
            del _specs[key]
    return len(keys)


def save_spec(spec: RunSpec) -> None:
    """Write ``spec`` to its run's folder in its store (and to this process's cache: a later
    :func:`load_spec` here sees it, e.g. after ``resume(max_epochs=)``)."""
    import cloudpickle

    spec.store.files.put(spec.spec_path, cloudpickle.dumps(spec))
    _remember((spec.store.location, spec.run_id), spec)


#: Where names that specs of earlier vcdask versions refer to live now (a spec pickles vcdask's own classes
#: and functions by reference, so a run written before a module moved still loads, resumes and exports).
MOVED_MODULES = {
    "vcdask.task": "vcdask.spec",  # RunSpec (train_shard / validate_version are in vcdask.worker)
    "vcdask.rules": "vcdask.merge",  # the merge rules
    "vcdask.api": "vcdask.options",  # the loss and metric functions
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED_MODULES.get(module, module), name)


def loads(data: bytes, store: Any = None) -> RunSpec:
    """A spec from its bytes (as :func:`save_spec` wrote them, by this or an earlier vcdask version); with
    ``store``, the store they were read from, bound to it (:func:`bind`).

    Unpickling opens no store (a store unpickles unopened: :class:`vcdask.store._copies.Unopened`), so the
    store the spec was written to is not opened, nor created, wherever it is now.
    """
    spec = _Unpickler(io.BytesIO(data)).load()
    return spec if store is None else bind(spec, store)


def bind(spec: RunSpec, store: Any) -> RunSpec:
    """``spec``, read from ``store``, with ``store`` as its store: the spec names the store it was written to,
    which is where ``store`` is unless the store was copied or moved since (``cp -r``, ``mv``, a tar round
    trip, a bucket copied).  The data staged in the run's folder is read from ``store`` too (its URL there);
    data read where it lives (a Zarr URL of the user's own, a ``Dataset``) is left as it is.

    Nothing of the store the spec was written to is opened.
    """
    written = spec.store
    changes: dict[str, Any] = {"store": store}
    for name in ("train", "validation"):
        source: Any = getattr(spec, name)  # a DataSource, a torch DatasetSource, or None
        staged = getattr(source, "store", None)  # (a DataSource staged in a store: that store, unopened)
        if staged is not None and source.path and staged.location == written.location:
            changes[name] = _with(source, store=store, url=store.files.url(source.path))
    return _with(spec, **changes)


def _with(obj: Any, **changes: Any) -> Any:
    """A shallow copy of the frozen dataclass ``obj`` with ``changes`` (``dataclasses.replace`` would call its
    constructor: a spec or source written by an earlier vcdask may lack a field that has no class default)."""
    out = copy.copy(obj)
    for name, value in changes.items():
        object.__setattr__(out, name, value)
    return out


def cached_spec(store, run_id: str) -> RunSpec | None:
    """The run's spec if this process has read it already (else None: nothing is read)."""
    with _lock:
        return _specs.get((store.location, run_id))


def load_spec(store, run_id: str) -> RunSpec:
    """The run's spec, read from the store once per process, bound to ``store`` (:func:`bind`)."""
    key = (store.location, run_id)
    with _lock:
        spec = _specs.get(key)
        if spec is not None:
            _specs.move_to_end(key)
    if spec is None:
        spec = loads(store.files.get(spec_path(run_id)), store)
        _remember(key, spec)
    elif spec.store is not store:  # (read through another object of the same store: e.g. read-only, for load)
        spec = bind(spec, store)
        _remember(key, spec)
    return spec
