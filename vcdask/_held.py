"""What a worker process holds between its tasks: versions read or brought, its threads' model copies, the
run's loss on its device, the devices it has warmed up; moving parameters to and from a device.  Used by
:mod:`vcdask.worker`."""

from __future__ import annotations

import asyncio
import copy
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ._wire import unpack
from .device import Precision, loss_tensors, loss_to, resolve_device
from .errors import ParameterMismatchError
from .params import FlatParams, copies_within, flatten, load_into
from .spec import RunSpec

__all__ = [
    "brought",
    "forget",
    "forget_losses",
    "keep_version",
    "loaded_model",
    "loss_on",
    "release_run",
    "setup",
    "to_cpu",
    "version_params",
    "warm_torch",
]


# -- per-process caches -------------------------------------------------------------------
_lock = threading.Lock()
_versions: OrderedDict[str, FlatParams] = OrderedDict()
#: run id -> the share of its shard's batches the run last gave this worker (``speed_adaptive``; ``worker``'s)
fractions: dict[str, float] = {}
_version_runs: dict[str, str] = {}  # version -> the run a task of which loaded it (:func:`forget_versions`)
_models = threading.local()
_MAX_VERSIONS = 4
#: ... and at most this many bytes of them (two versions at least: a task's base and the next one's)
_VERSIONS_BYTES = 512 << 20


class _Models(OrderedDict):
    """One thread's model copies, by ``(run_id, device)``: its own (``_models.by_run``), and listed in
    ``_every_thread`` so a run's end can drop them from every thread (they go with their thread too)."""


_every_thread: weakref.WeakValueDictionary[int, _Models] = weakref.WeakValueDictionary()
#: Models kept per thread (one per run and device): the runs this worker trained lately.
_MAX_MODELS = 3


def version_params(store, version: str) -> FlatParams:
    with _lock:
        params = _versions.get(version)
        if params is not None:
            _versions.move_to_end(version)
            return params
    return keep_version(version, store.read(version).params)


#: The accelerators this process trained on (:func:`setup`): where a run's end gives cached memory back, and,
#: once one is a CUDA device, the versions it keeps are pinned.  A process that trains on its CPU pins nothing
#: even where it sees a GPU: pinning would create a CUDA context there (hundreds of MB of the GPU's memory a
#: process) and lock host memory for nothing.
_trained_on: set[torch.device] = set()


def _pinned(params: FlatParams) -> FlatParams:
    if any(d.type == "cuda" for d in list(_trained_on)):  # copies to a GPU from pinned memory do not block
        params = FlatParams(params.layout, {d: a.pin_memory() for d, a in params.arrays.items()})
    return params


def keep_version(version: str, params: FlatParams) -> FlatParams:
    """Keep ``params`` as ``version``'s (read from the store, or brought by the run's answer)."""
    params = _pinned(params)
    with _lock:
        _versions[version] = params
        _versions.move_to_end(version)
        kept = copies_within(_MAX_VERSIONS, _VERSIONS_BYTES, params.nbytes)
        while len(_versions) > kept:  # (a large model's older versions go: tasks rarely read them again)
            _version_runs.pop(_versions.popitem(last=False)[0], None)
    return params


def _model(spec: RunSpec, device: torch.device) -> torch.nn.Module:
    """A private copy of the run's model on ``device`` for this thread (threads never share a module)."""
    models = getattr(_models, "by_run", None)
    if models is None:
        models = _models.by_run = _Models()
        with _lock:
            _every_thread[id(models)] = models
    # (an old run's copy, and its device memory, goes past _MAX_MODELS)
    return _newest(models, (spec.run_id, str(device)), lambda: copy.deepcopy(spec.model).to(device))


def _newest(cache: OrderedDict, key: Any, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` if it is not there, as the cache's newest entry; the oldest entries
    past :data:`_MAX_MODELS` go.  Under the process's lock (forget may drop a run's entries from any thread),
    but not while it makes one."""
    with _lock:
        value = cache.get(key)
    if value is None:
        value = make()
    with _lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > _MAX_MODELS:
            cache.popitem(last=False)
    return value


_losses: OrderedDict[tuple[str, str], Callable] = OrderedDict()  # (run_id, device) -> the loss there


def loss_on(spec: RunSpec, device: torch.device) -> Callable:
    """The run's loss for the default step of a task on ``device``.

    A loss module's tensors (``CrossEntropyLoss(weight=...)``'s class weights; on the CPU in the run's spec), and
    a :func:`functools.partial`'s tensor arguments (``partial(F.cross_entropy, weight=w)``), are copied to
    ``device`` once per run and device in this process, as the model is: a CUDA worker's every task failed on the
    outputs and the weights being on two devices.  A loss function, or one whose tensors are already there, is
    the spec's own.  The copy is shared by the process's threads (a loss keeps no state of a step).
    """
    loss = spec.loss
    if all(t.device == device for t in loss_tensors(loss)):
        return loss
    # (the spec's stays on the CPU: validation computes it there)
    return _newest(_losses, (spec.run_id, str(device)), lambda: loss_to(loss, device))


def brought(version: str | None, payload: dict[str, Any]) -> FlatParams:
    """The base an answer brought packed (:func:`vcdask._wire.pack`): this worker's copy of ``version``
    if it has one, else the payload unpacked (and kept as ``version``'s; a draft, with no id, is not)."""
    if version is None:
        return _pinned(unpack(payload))
    with _lock:
        kept = _versions.get(version)
    return kept if kept is not None else keep_version(version, unpack(payload))


def loaded_model(
    spec: RunSpec, store, version: str | None, device: torch.device, params: FlatParams | None = None
) -> torch.nn.Module:
    """This thread's copy of the model holding ``version`` (whose ``params`` may be at hand), on ``device``."""
    if params is None:
        assert version is not None, "a version or its parameters"
        params = version_params(store, version)
    if version is not None:
        with _lock:
            _version_runs[version] = spec.run_id
    if device.type != "cpu":  # one copy per dtype to the device, then device-to-device into the tensors
        # (asynchronous only from pinned memory: from pageable memory (MPS) the source may go, with the version
        # evicted from the cache by another thread, before the copy has read it)
        params = FlatParams(
            params.layout, {d: a.to(device, non_blocking=a.is_pinned()) for d, a in params.arrays.items()}
        )
    model = _model(spec, device)
    try:
        load_into(model, params)
    except ParameterMismatchError:  # user code reshaped this copy last time: start afresh
        model = copy.deepcopy(spec.model).to(device)
        with _lock:
            _models.by_run[(spec.run_id, str(device))] = model
        load_into(model, params)
    return model


def forget(run_id: str) -> int:
    """Drop every thread's copies of run ``run_id``'s model (the run ended); how many there were."""
    with _lock:
        dropped = 0
        for models in list(_every_thread.values()):
            for key in [k for k in models if k[0] == run_id]:
                del models[key]
                dropped += 1
    return dropped


def forget_versions(run_id: str) -> int:
    """Drop the versions run ``run_id``'s tasks loaded (pinned host memory on a CUDA worker: up to
    :data:`_MAX_VERSIONS` models' worth, kept after the run ended until other runs' versions pushed them out);
    how many there were."""
    with _lock:
        versions = [v for v, run in _version_runs.items() if run == run_id]
        for version in versions:
            _versions.pop(version, None)
            del _version_runs[version]
    return len(versions)


def forget_losses(run_id: str) -> int:
    """Drop run ``run_id``'s loss copies (:func:`loss_on`); how many there were."""
    with _lock:
        keys = [k for k in _losses if k[0] == run_id]
        for key in keys:
            del _losses[key]
    return len(keys)


async def release_run(run_id: str) -> dict[str, int]:
    """Let go of what this worker process keeps for run ``run_id``, which ended: its spec and rows, its threads'
    model copies and its loss's, hand-overs (each a ``W_c``) and optimizer states, on the device they trained on,
    and its compressed updates' residuals; then give the device memory freed back (for the next run, or another
    process on a shared GPU).  The run's end calls it on the workers that trained for it
    (:func:`vcdask.engine.end.release_on_workers`); without it they stay until the caches' bounds push them
    out, runs later.  A copy of the run's task still training when it ended keeps what it keeps on the same
    terms.  Runs in a thread, off the worker's event loop (freeing device memory waits for the device).
    Returns what it dropped, by kind.
    """
    return await asyncio.to_thread(_release, run_id)


def _release(run_id: str) -> dict[str, int]:
    from . import batches, compress, inner, overlap, spec

    dropped = {
        "specs": spec.forget(run_id),  # (a resumed run may have a new one: more epochs, its schedule's length)
        "rows": batches.forget(run_id),
        "models": forget(run_id),
        "versions": forget_versions(run_id),
        "fractions": int(fractions.pop(run_id, None) is not None),
        "losses": forget_losses(run_id),
        "hand_overs": overlap.forget(run_id),
        "optimizer_states": inner.forget(run_id),
        "residuals": compress.forget(run_id),
    }
    for device in list(_trained_on):  # (the cached blocks go back to the device; tensors in use stay)
        if device.type == "cuda":
            with torch.cuda.device(device):  # (no context made on another GPU)
                torch.cuda.empty_cache()
        elif device.type == "mps":
            torch.mps.empty_cache()
    return dropped


def to_cpu(model: torch.nn.Module, device: torch.device) -> FlatParams:
    """``W_c`` as CPU flat arrays (packed on the device, then one copy per dtype)."""
    if device.type == "cpu":
        return flatten(model)
    on_device = flatten(model, device=device)
    pin = device.type == "cuda"
    arrays = {
        d: torch.empty(a.shape, dtype=a.dtype, pin_memory=pin).copy_(a, non_blocking=pin)
        for d, a in on_device.arrays.items()
    }
    if pin:
        torch.cuda.synchronize(device)
    return FlatParams(on_device.layout, arrays)


#: Each worker thread's CUDA device before a run set one: what ``device="auto"`` means there.
_own_cuda = threading.local()


def _own_gpu(device: Any) -> bool:
    """Whether ``device`` (a run's) means the worker's own GPU: ``"auto"``, or CUDA without an index."""
    if isinstance(device, str) and device == "auto":
        return True
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        return False
    return dev.type == "cuda" and dev.index is None


def setup(spec: RunSpec) -> tuple[torch.device, Precision]:
    """The device a task of ``spec`` trains on (made the thread's current CUDA device), and its precision.

    ``device="auto"`` (and ``"cuda"``, no index) is the thread's own CUDA device, the one it had before any
    run set one: CUDA's current device is per thread and Dask's worker threads outlive tasks, so after a run
    on ``"cuda:1"`` the next run's ``"auto"`` trained on that GPU too (under dask-cuda, another worker's).
    """
    torch.set_num_threads(spec.torch_threads)
    if _own_gpu(spec.device) and torch.cuda.is_available():
        own = getattr(_own_cuda, "index", None)
        if own is None:
            own = _own_cuda.index = torch.cuda.current_device()
        device = torch.device("cuda", own)
    else:
        device = resolve_device(spec.device)
    if device.type == "cuda":
        if getattr(_own_cuda, "index", None) is None:
            _own_cuda.index = torch.cuda.current_device()  # (before this run sets another)
        torch.cuda.set_device(device)
    if device.type != "cpu":
        _trained_on.add(device)
    return device, Precision(spec.precision, device)


_torch_warm: set[str] = set()  # the devices warmed up in this process


def warm_torch(device: torch.device) -> None:
    """Pay, once per process and device, what PyTorch's first training step costs before a task asks
    for its base.

    The first optimizer built in a process imports ``torch._dynamo``: 1.7-3.7 s on a freshly spawned
    worker, against milliseconds for a small model's whole task.  Paid after the base was chosen, it
    counted as staleness: a cold worker's first update came back 14-18 merges old and was rejected.
    On a GPU the first use of the device also creates its CUDA context and cuBLAS handle (hundreds of
    milliseconds to seconds): a matrix product and a backward pass there pay them here.
    """
    if str(device) in _torch_warm:
        return
    weight = torch.nn.Parameter(torch.zeros(4, 4, device=device))
    torch.optim.SGD([weight], lr=0.0)  # any optimizer: the import is the cost
    with torch.enable_grad():  # and autograd's first backward (whatever this thread's grad mode)
        (weight @ weight + 2.0).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _torch_warm.add(str(device))
