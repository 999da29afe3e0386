"""A shard's rows on a worker, and the batches a task trains or validates on.

Rows read from arrays (staged or where they live) are cached per worker process as tensors (the
paper's "sticky files"); a task then cuts batches from them in a seeded order and moves each to its
device.  On a GPU a shard that fits is copied once (from pinned memory, without blocking) and cut
there; otherwise, and for a torch ``Dataset`` (whose items may be slow to read), the next batch is
made in a background thread while the current one trains.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from .device import to
from .errors import StoreError
from .torch_data import DatasetSource

__all__ = ["Rows", "batch_bounds", "batches", "cast_like_training", "forget", "on_device", "prefetch", "rows"]

_lock = threading.Lock()
_cache: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()  # rows by :func:`_key`
_MAX_ROW_BYTES = 2 << 30
_ON_DEVICE_BYTES = 1 << 30  # a GPU shard up to this size is copied whole, then cut into batches there

#: The rows of a shard: columns of tensors (``{"X", "y"}`` for (X, y) data), or a dataset's index range.
Rows = dict[str, torch.Tensor] | DatasetSource


def cast_like_training(t: torch.Tensor, spec, name: str = "X", dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` (the column ``name`` of a batch) in the dtype the run trains on: the one rule for training,
    validation, :func:`vcdask.predict.model_outputs` and a job's release scores.

    Labels (``"y"`` of ``(X, y)`` data) become int64 for a classifier, the model's dtype otherwise; floating
    columns become the model's dtype, and so do integer inputs ``X`` unless the run keeps them (``spec.cast_x``
    is False for a model that takes integers, such as an embedding).

    Parameters
    ----------
    t : torch.Tensor
    spec : RunSpec
        The run: ``batch_form``, ``classification``, ``x_dtype``, ``cast_x``.
    name : str, default "X"
        The column: ``"X"`` or ``"y"`` for ``(X, y)`` data, a variable's name for dict batches.
    dtype : torch.dtype, optional
        The model's dtype, where it is not the run's ``spec.x_dtype`` any more (predicting with a model cast
        after the run, ``model.double()``).
    """
    dtype = spec.x_dtype if dtype is None else dtype
    if spec.batch_form == "xy" and name == "y":
        return t.long() if spec.classification else t.to(dtype)
    if t.is_floating_point() or (spec.cast_x and name == "X"):
        return t.to(dtype)
    return t


def _tensor(a: np.ndarray, spec, name: str) -> torch.Tensor:
    return cast_like_training(torch.as_tensor(np.ascontiguousarray(a)), spec, name)


def _key(spec, source, start: int, stop: int, pin: bool) -> tuple:
    """The cache key of rows ``[start, stop)`` of ``source`` for ``spec``'s run: its own, whatever other run
    reads the same data.  The rows are kept cast as the run trains on them (:func:`cast_like_training`:
    another run may train another model dtype or task on them), and data read where it lives may be
    rewritten there between two runs."""
    return (spec.run_id, *source.cache_key, start, stop, pin)


def forget(run_id: str) -> int:
    """Drop the rows cached for run ``run_id`` (it ended); how many shards' rows there were."""
    with _lock:
        keys = [key for key in _cache if key[0] == run_id]
        for key in keys:
            del _cache[key]
    return len(keys)


def cached_rows(spec, source, start: int, stop: int, *, pin: bool = False) -> Rows | None:
    """What :func:`rows` returns, if it has these rows at hand (None: they would be read); a dataset's
    items are read batch by batch, later, so its rows are always at hand."""
    if isinstance(source, DatasetSource):
        return source.slice(start, stop)
    key = _key(spec, source, start, stop, pin)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
        return hit


def rows(spec, source, start: int, stop: int, *, pin: bool = False) -> Rows:
    """Rows ``[start, stop)`` of ``source``, cached per process (pinned when the worker trains on a GPU).

    Raises
    ------
    StoreError
        The storage holding the data failed (a store fault, not the worker's).
    """
    hit = cached_rows(spec, source, start, stop, pin=pin)
    if hit is not None:
        return hit
    key = _key(spec, source, start, stop, pin)
    try:
        arrays = source.read_columns(start, stop)
    except (FileNotFoundError, PermissionError):
        raise  # not transient: the data is not there, or not for us
    except OSError as e:  # e.g. a 503 from object storage
        raise StoreError(f"reading rows {start}:{stop} of {source.url or 'the data'}: {e}") from e
    columns = {k: _tensor(a, spec, k) for k, a in arrays.items()}
    if pin:
        columns = {k: t.pin_memory() for k, t in columns.items()}
    with _lock:
        _cache[key] = columns
        while sum(_nbytes(c) for c in _cache.values()) > _MAX_ROW_BYTES and len(_cache) > 1:
            _cache.popitem(last=False)
    return columns


def _nbytes(columns: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in columns.values())


def n_rows(r: Rows) -> int:
    return r.n if isinstance(r, DatasetSource) else len(next(iter(r.values())))


def _cut(columns: dict[str, torch.Tensor], idx: torch.Tensor, form: str) -> Any:
    if form == "xy":
        return columns["X"][idx], columns["y"][idx]
    return {k: t[idx] for k, t in columns.items()}


def _class_ids(batch: Any, spec) -> Any:
    """A dataset's ``(x, y)`` batch with its labels as the run's class ids (int64) when it classifies: labels
    of another integer type or bool (as the pre-run check casts them) would fail the loss on every worker."""
    if (
        spec.classification
        and isinstance(batch, (tuple, list))
        and len(batch) == 2
        and isinstance(batch[1], torch.Tensor)
        and not batch[1].is_floating_point()
        and batch[1].dtype != torch.int64
    ):
        return _with_labels(batch, batch[1].long())
    return batch


def _with_labels(batch: tuple | list, y: torch.Tensor) -> Any:
    """``batch`` (``(x, y)``) with ``y`` for its labels, of its own type: a namedtuple keeps its fields (the step
    reads ``batch.y``), a list or tuple subclass stays one (a plain one where it cannot be made)."""
    if type(batch) is tuple:
        return batch[0], y
    if isinstance(batch, tuple):
        if hasattr(batch, "_replace"):
            return batch._replace(**{batch._fields[1]: y})  # type: ignore[attr-defined]
        try:
            return type(batch)((batch[0], y))
        except TypeError:
            return batch[0], y
    try:
        clone = copy.copy(batch)
        clone[1] = y
        return clone
    except TypeError:
        return [batch[0], y]


def batch_bounds(n: int, batch_size: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of each batch :func:`batches` cuts from ``n`` rows: ``batch_size`` rows each, the
    last one short, but never a lone row after another batch.

    A lone last row trained as a batch of its own fails every model with a ``torch.nn.BatchNorm1d`` in train
    mode ("Expected more than 1 value per channel when training") on every try of its task, and the shards'
    sizes are the run's, not the user's (with ``batch_size=32``, 343 training sizes from 100 to 3000 left a
    shard such a row).  The batch before gives it one of its rows instead, so no row is left out and a shard
    still takes ``ceil(n / batch_size)`` steps, as :func:`vcdask.lr_schedules.run_steps`, the worker's share
    of a speed-adapted shard and the run's record count them.  With ``batch_size=2`` there is none to give: the
    row joins the batch before (3 rows), one step fewer.  A batch of one row is left only where the run asks for
    it: a shard of one row (nothing to join it to), or ``batch_size=1``.

    Parameters
    ----------
    n : int
        The shard's rows.
    batch_size : int
        The rows of a batch (at least 1).

    Returns
    -------
    list of tuple of int
        Contiguous, in order, covering ``range(n)`` once; empty for ``n == 0``.

    Examples
    --------
    >>> batch_bounds(7, 3)
    [(0, 3), (3, 5), (5, 7)]
    >>> batch_bounds(5, 2)
    [(0, 2), (2, 5)]
    """
    bounds = [(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    if batch_size > 1 and len(bounds) > 1 and n - bounds[-1][0] == 1:  # a lone last row after a full batch
        start, stop = bounds[-2]
        bounds[-2:] = [(start, stop - 1), (stop - 1, n)] if batch_size > 2 else [(start, n)]
    return bounds


def batches(
    spec,
    r: Rows,
    device: torch.device,
    batch_size: int,
    *,
    generator: torch.Generator | None = None,
    limit: int | None = None,
) -> Iterator[tuple[Any, int]]:
    """``(batch, n_samples)`` pairs over ``r`` on ``device``, cut as :func:`batch_bounds` says: shuffled by
    ``generator``, else in order; only the first ``limit`` batches when given (a speed-adapted task's share
    of its shard)."""
    n = n_rows(r)
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    bounds = batch_bounds(n, batch_size)[:limit]
    spans = [order[i:j] for i, j in bounds]
    if isinstance(r, DatasetSource):
        yield from prefetch(
            (to(_class_ids(r.batch(idx.tolist()), spec), device, spec.x_dtype), len(idx)) for idx in spans
        )
        return
    if device.type == "cpu":
        yield from ((_cut(r, idx, spec.batch_form), len(idx)) for idx in spans)
        return
    if _nbytes(r) <= _ON_DEVICE_BYTES:  # one copy of the shard (none if the task made it), batches cut there
        columns = _moved(r, device)
        # the order copied once: a copy from pageable memory per batch would wait for the device's queue each
        # time, so the next step could not be queued while the last one ran
        order = order.to(device)
        yield from ((_cut(columns, order[i:j], spec.batch_form), j - i) for i, j in bounds)
        return
    yield from prefetch((to(_cut(r, idx, spec.batch_form), device), len(idx)) for idx in spans)


def on_device(r: Rows, device: torch.device) -> Rows:
    """A shard's rows for a task on ``device``: the columns copied there once where :func:`batches` cuts its
    batches on the device (a GPU shard up to ``_ON_DEVICE_BYTES``), so a task of several local epochs copies
    them once; else ``r`` as it is (no copy for rows already there)."""
    if isinstance(r, DatasetSource) or device.type == "cpu" or _nbytes(r) > _ON_DEVICE_BYTES:
        return r
    return _moved(r, device)


def _moved(columns: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: t.to(device, non_blocking=t.is_pinned()) for k, t in columns.items()}


_DONE = object()


def prefetch(items: Iterable[Any], depth: int = 2) -> Iterator[Any]:
    """Iterate ``items`` with up to ``depth`` of them made ahead in a background thread.

    An exception raised while making an item is raised here, in order; stopping early stops the thread.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def fill() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put((item, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((_DONE, e))
            return
        q.put((_DONE, None))

    thread = threading.Thread(target=fill, name="vcdask-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, error = q.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.01)
