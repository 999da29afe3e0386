"""Client updates ``W_c`` in transit: one plain object per update in the store's run folder.

An update is an uncompressed ``.npz`` (readable with ``numpy.load``): one array per dtype
plus the layout as JSON bytes, written in a single request by the worker that trained
it, read once by the merge thread, deleted once its merge is committed.  A compressed update
(:mod:`vcdask.compress`) holds its encoded parts (``"<dtype>.<part>"``) and a ``__codec__``
record (the codec and the base version) instead of the float arrays.  This module is the
only place that writes, reads, lists or deletes updates.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import torch

from . import _npz
from .compress import EncodedUpdate
from .params import FlatParams, Layout, torch_dtype

__all__ = [
    "delete_run_updates",
    "delete_update",
    "list_updates",
    "read_update",
    "read_update_meta",
    "update_path",
    "write_update",
]

logger = logging.getLogger(__name__)


def update_path(run_id: str, epoch: int, shard: int, attempt: int) -> str:
    """Where the update of one shard-training attempt lives, relative to ``<store>/runs``."""
    return f"{_folder(run_id)}/e{epoch:05d}-s{shard:05d}-a{attempt:03d}.npz"


def _folder(run_id: str) -> str:
    return f"{run_id}/updates"


def write_update(files, path: str, params: FlatParams | EncodedUpdate, meta: dict | None = None) -> int:
    """Write ``params`` (and a small JSON ``meta`` record) to ``path`` in one request; return the bytes written."""
    tensors = params.arrays if isinstance(params, FlatParams) else params.parts
    arrays = {name: _to_numpy(a) for name, a in tensors.items()}
    arrays["__layout__"] = _json(params.layout.to_dict())
    arrays["__meta__"] = _json(meta or {})
    if isinstance(params, EncodedUpdate):
        arrays["__codec__"] = _json({"codec": params.codec, "base_version": params.base_version})
    return files.put_parts(path, _npz.dump_parts(arrays))


def read_update(files, path: str) -> FlatParams | EncodedUpdate:
    """Read an update written by :func:`write_update`: ``W_c``, or an :class:`EncodedUpdate` to decode
    against its base version."""
    z = _npz.loads(files.get_buffer(path))  # arrays viewing one writable buffer: no further copy
    layout = Layout.from_dict(json.loads(z["__layout__"].tobytes()))
    if "__codec__" not in z:
        return FlatParams(layout, {dtype: _to_torch(z[dtype], dtype) for dtype in layout.sizes})
    codec = json.loads(z["__codec__"].tobytes())
    parts = {}
    for name, a in z.items():
        if not name.startswith("__"):
            bf16 = codec["codec"] == "bf16" and name.endswith(".delta")  # stored as uint16
            parts[name] = _to_torch(a, "bfloat16" if bf16 else None)
    return EncodedUpdate(layout, codec["codec"], codec["base_version"], parts)


def _to_numpy(a: torch.Tensor) -> np.ndarray:
    return (a.view(torch.uint16) if a.dtype == torch.bfloat16 else a).numpy()


def _to_torch(a: np.ndarray, dtype: str | None) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(torch_dtype(dtype)) if dtype == "bfloat16" else t


def _json(record: dict) -> np.ndarray:
    return np.frombuffer(json.dumps(record).encode(), dtype=np.uint8)


def read_update_meta(files, path: str) -> dict:
    """The ``meta`` record stored with an update (epoch, shard, attempt, base_step, ...)."""
    z = _npz.loads(files.get(path))
    return json.loads(z["__meta__"].tobytes()) if "__meta__" in z else {}


def list_updates(files, run_id: str) -> list[str]:
    """Paths of the run's updates still in the store."""
    return files.list(_folder(run_id))


def delete_update(files, path: str, *, strict: bool = False) -> bool:
    """Delete one update that has done its job (merged and committed, rejected, or a duplicate).

    Best effort unless ``strict``: a store fault is logged and the update is left for the end of the
    run (:func:`delete_run_updates`).  Returns whether it is gone.
    """
    try:
        files.delete(path)
        return True
    except OSError as e:
        if strict:
            raise
        logger.warning("could not delete the update %s (left for the end of the run): %s", path, e)
        return False


def delete_run_updates(files, run_id: str) -> None:
    """Delete every update of a run that is left (at its end); best effort."""
    try:
        for path in list_updates(files, run_id):
            files.delete(path)
    except OSError as e:  # the run's result does not depend on it
        logger.warning("run %s: could not remove its leftover update objects: %s", run_id, e)
