"""A map-style ``torch.utils.data.Dataset`` as training or validation data.

Shards are index ranges.  The dataset travels to the workers inside the run's spec (cloudpickle), so
it must pickle: a dataset that reads files should keep their paths and open them on first use in
the worker, as one written for ``DataLoader(num_workers>0)`` already does.  Batches are the
dataset's items put together by ``collate_fn`` (default: ``torch.utils.data.default_collate``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from .errors import DataError

__all__ = ["DatasetSource", "cpu_numpy", "is_dataset", "loader_error", "prepare_dataset"]


def is_dataset(data: Any) -> bool:
    """Whether ``data`` is a torch dataset (map-style or iterable)."""
    return isinstance(data, torch.utils.data.Dataset)


def loader_error(data: Any, what: str = "data") -> TypeError | None:
    """What to pass instead of a ``torch.utils.data.DataLoader``: its dataset (vcdask shards it and makes the
    batches itself); None for anything else.

    Parameters
    ----------
    data : object
        The data given to ``fit``.
    what : str
        ``"data"`` or ``"validation"``, for the message.

    Returns
    -------
    TypeError or None
        The refusal of a DataLoader, naming its batch size and (one of its own) its ``collate_fn`` as ``fit``'s
        options.
    """
    if not isinstance(data, torch.utils.data.DataLoader):
        return None
    options = [] if data.batch_size is None else [f"batch_size={data.batch_size}"]
    if data.collate_fn not in (torch.utils.data.default_collate, torch.utils.data.default_convert):
        options.append("collate_fn=loader.collate_fn")
    given = "fit(model, loader.dataset, ...)" if what == "data" else "validation=loader.dataset"
    keep = (
        f" To keep the loader's: fit(model, loader.dataset, {', '.join(options)})" if options and what == "data" else ""
    )
    return TypeError(
        f"{what} is a torch DataLoader ({type(data.dataset).__name__} in batches): pass its dataset, {given}. "
        "vcdask shards the dataset over the cluster and makes each shard's batches itself, on the workers: the "
        f"batch size is fit's batch_size= (default 32), the collate function fit's collate_fn=.{keep}"
    )


@dataclass(frozen=True)
class DatasetSource:
    """Items ``[offset, offset + n)`` of a map-style dataset.

    Attributes
    ----------
    dataset : torch.utils.data.Dataset
    n : int
    offset : int
    collate_fn : callable or None
        Items -> batch; None for ``torch.utils.data.default_collate``.
    """

    dataset: Any
    n: int
    offset: int = 0
    collate_fn: Any = None
    url = None  # for messages that name a source's location

    @property
    def cache_key(self) -> tuple:
        return (id(self.dataset), self.offset, self.n)

    def batch(self, indices) -> Any:
        """The collated batch of items ``indices`` (relative to this source)."""
        collate = self.collate_fn or torch.utils.data.default_collate
        return collate([self.dataset[self.offset + int(i)] for i in indices])

    def slice(self, start: int, stop: int) -> DatasetSource:
        """A source for items ``[start, stop)`` of this one."""
        return replace(self, n=stop - start, offset=self.offset + start)


def prepare_dataset(data: Any, *, collate_fn=None, what: str = "data"):
    """Check a torch dataset and describe it (collates a probe batch of its first items).

    Raises
    ------
    TypeError
        An iterable-style dataset (it has no index ranges to shard), or one that does not pickle.
    DataError
        An empty dataset, or items that ``collate_fn`` cannot put together.
    """
    from .prepared import PreparedData

    if isinstance(data, torch.utils.data.IterableDataset) or not hasattr(data, "__len__"):
        raise TypeError(
            f"{what}: an iterable-style dataset ({type(data).__name__}) has no index ranges to shard; "
            "pass a map-style Dataset (with __len__ and __getitem__), arrays, or an xarray/Zarr dataset"
        )
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"collate_fn must be a callable list of items -> batch, got {type(collate_fn).__name__}")
    n = len(data)
    if n == 0:
        raise DataError(f"{what} is an empty dataset (len 0)")
    try:
        import cloudpickle

        cloudpickle.dumps(data)
    except Exception as e:
        raise TypeError(
            f"{what}: the dataset must pickle to reach the workers ({type(e).__name__}: {e}); keep file paths "
            "in it and open files on first use"
        ) from e
    source = DatasetSource(data, n, collate_fn=collate_fn)
    try:
        sample = source.batch(range(min(4, n)))
    except Exception as e:
        sizes = collate_fn is None and "equal size" in str(e)  # (default_collate's torch.stack of unequal items)
        hint = (
            "; items of different sizes (sequences of different lengths) need fit(..., collate_fn=fn(items) -> "
            "batch) that pads them to one size (torch.nn.utils.rnn.pad_sequence), or items of one size"
            if sizes
            else ""
        )
        raise DataError(
            f"{what}: cannot make a batch of the dataset's first items: {type(e).__name__}: {e}{hint}"
        ) from e
    prepared = PreparedData(None, n=n, form="dataset", sample=sample)
    prepared.source = source  # type: ignore[assignment]  # a DatasetSource reads where the data lives too
    if isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[1], torch.Tensor):
        x, y = sample
        prepared.y_dtype = cpu_numpy(y).dtype
        if isinstance(x, torch.Tensor):
            prepared.x_shape, prepared.sample_X, prepared.sample_y = tuple(x.shape[1:]), cpu_numpy(x), cpu_numpy(y)
        if not y.is_floating_point():  # the labels' range is checked against the model's outputs
            labels = _all_labels(data) if collate_fn is None else None
            labels = y if labels is None else labels  # (another dataset: its probe batch's labels only)
            prepared.y_min, prepared.y_max = int(labels.min()), int(labels.max())
    return prepared


def _all_labels(data: Any) -> torch.Tensor | None:
    """Every label of a ``TensorDataset`` of ``(x, y)`` (its labels tensor: cheap to range); None for another
    dataset, whose labels would have to be read item by item."""
    if isinstance(data, torch.utils.data.TensorDataset) and len(data.tensors) == 2:
        return data.tensors[1].detach()
    return None


def cpu_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as a NumPy array: from the CPU (a dataset may give items on a GPU, a user a tensor on one),
    in float32 where NumPy has no such dtype (bfloat16, float8; floating data trains in the model's dtype)."""
    t = t.detach().cpu()
    try:
        return t.numpy()
    except TypeError:  # (NumPy has no bfloat16)
        return t.float().numpy()
