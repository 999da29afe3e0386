"""Client updates ``W_c`` in transit: one plain object per update in the store's run folder.

An update is an uncompressed ``.npz`` (readable with ``numpy.load``): one array per dtype
plus the layout as JSON bytes, written in a single request by the worker that trained
it, read once by the merge thread, deleted once its merge is committed.
"""

from __future__ import annotations

import io
import json

import numpy as np
import torch

from .params import FlatParams, Layout, torch_dtype

__all__ = ["read_update", "read_update_meta", "update_path", "write_update"]


def update_path(run_id: str, epoch: int, shard: int, attempt: int) -> str:
    """Where the update of one shard-training attempt lives, relative to ``<store>/runs``."""
    return f"{run_id}/updates/e{epoch:05d}-s{shard:05d}-a{attempt:03d}.npz"


def write_update(files, path: str, params: FlatParams, meta: dict | None = None) -> int:
    """Write ``params`` (and a small JSON ``meta`` record) to ``path`` in one request; return the bytes written."""
    arrays = {}
    for dtype, a in params.arrays.items():
        arrays[dtype] = (a.view(torch.uint16) if dtype == "bfloat16" else a).numpy()
    arrays["__layout__"] = np.frombuffer(json.dumps(params.layout.to_dict()).encode(), dtype=np.uint8)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta or {}).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    data = buf.getvalue()
    files.put(path, data)
    return len(data)


def read_update(files, path: str) -> FlatParams:
    """Read an update written by :func:`write_update`."""
    with np.load(io.BytesIO(files.get(path)), allow_pickle=False) as z:
        layout = Layout.from_dict(json.loads(z["__layout__"].tobytes()))
        arrays = {}
        for dtype in layout.sizes:
            t = torch.from_numpy(z[dtype].copy())
            arrays[dtype] = t.view(torch_dtype(dtype)) if dtype == "bfloat16" else t
    return FlatParams(layout, arrays)


def read_update_meta(files, path: str) -> dict:
    """The ``meta`` record stored with an update (epoch, shard, attempt, base_step, ...)."""
    with np.load(io.BytesIO(files.get(path)), allow_pickle=False) as z:
        return json.loads(z["__meta__"].tobytes()) if "__meta__" in z.files else {}
