"""How one version is laid out in Zarr (inside an Icechunk snapshot).

::

    /                       attrs: {"vcdask:format": 1}
    /params                 attrs: {"vcdask:layout": {"format": 1, "entries": [...]}}
    /params/float32         1-D array, all float32 tensors back to back (chunked, uncompressed)
    /params/int64           1-D array, e.g. BatchNorm's num_batches_tracked (only if present)
    /rule/<name>            a merge rule's state (e.g. momentum), laid out like /params

So a version is one or two arrays: a handful of object-store requests however many
tensors the model has.  Each layout entry gives ``name``, ``shape``, ``dtype`` and
``offset`` into the array named by its dtype; ``bfloat16`` is stored as ``uint16``
bits with the array attribute ``"vcdask:dtype": "bfloat16"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..params import FlatParams, Layout, torch_dtype
from ._version import VersionInfo

if TYPE_CHECKING:
    import icechunk

FORMAT_KEY = "vcdask:format"
LAYOUT_KEY = "vcdask:layout"
DTYPE_KEY = "vcdask:dtype"
FORMAT = 1


def version_info(snap: icechunk.SnapshotInfo, parent: str | None) -> VersionInfo:
    """A snapshot as a :class:`VersionInfo` (vcdask's own metadata keys left out)."""
    meta = {k: v for k, v in (snap.metadata or {}).items() if not k.startswith("vcdask:")}
    return VersionInfo(id=snap.id, parent=parent, written_at=snap.written_at, message=snap.message, metadata=meta)


def is_version(snap: icechunk.SnapshotInfo) -> bool:
    """Whether a snapshot is a vcdask version (not e.g. the repository's empty root)."""
    return FORMAT_KEY in (snap.metadata or {})


def write_flat(zstore: Any, flat: FlatParams, chunk_bytes: int, path: str = "params") -> None:
    """Write ``flat`` into the group at ``path``, reusing arrays whose shape and dtype still fit."""
    import zarr

    root = zarr.open_group(zstore, mode="a")
    if root.attrs.get(FORMAT_KEY) != FORMAT:
        root.attrs[FORMAT_KEY] = FORMAT
    group = root.require_group(path)
    existing = dict(group.arrays())
    for dtype, values in flat.arrays.items():
        data, zdtype = _to_numpy(values, dtype)
        arr = existing.pop(dtype, None)
        if arr is None or arr.shape != data.shape or arr.dtype != zdtype:
            chunk = max(1, min(data.size, chunk_bytes // zdtype.itemsize))
            arr = group.create_array(
                dtype,
                shape=data.shape,
                chunks=(chunk,),
                dtype=zdtype,
                compressors=None,
                fill_value=0,
                dimension_names=[f"n_{dtype}"],
                overwrite=True,
                attributes={DTYPE_KEY: dtype},
            )
        if data.size:
            write_all(arr, data)
    for stale in existing:  # a dtype the new layout no longer has
        del group[stale]
    layout = flat.layout.to_dict()
    if group.attrs.get(LAYOUT_KEY) != layout:
        group.attrs[LAYOUT_KEY] = layout


def write_all(arr: Any, data: np.ndarray) -> None:
    """``arr[:] = data``, every chunk written, zeros too: zarr's check for chunks equal to the fill value
    compares each chunk bytewise (a void-dtype ``array_equal``), which took most of a commit.
    (``Array.with_config`` is zarr 3.1.6's; before it, the check stays.)"""
    with_config = getattr(arr, "with_config", None)
    (arr if with_config is None else with_config({"write_empty_chunks": True}))[:] = data


def write_state(zstore: Any, state: Mapping[str, FlatParams] | None, chunk_bytes: int) -> None:
    """The merge rule's state (e.g. momentum) in ``/rule/<name>``, versioned with the parameters."""
    import zarr

    root = zarr.open_group(zstore, mode="a")
    if not state:
        if "rule" in root:
            del root["rule"]
        return
    rule = root.require_group("rule")
    for stale in set(rule.group_keys()) - set(state):
        del rule[stale]
    for name, flat in state.items():
        write_flat(zstore, flat, chunk_bytes, path=f"rule/{name}")


def read_flat_at(zstore: Any, path: str = "params") -> FlatParams:
    """The flat parameters in the group at ``path`` of ``zstore`` (written by :func:`write_flat`), read
    in one trip to Zarr's event loop.

    Zarr's synchronous API makes one trip per call (open the group, then each array, then its
    values: three for a model of one dtype), each a hand-over to Zarr's I/O thread and back.  On
    two busy cores that took a small model's version read (digits' CNN) from 4 ms alone to 10 ms
    in a run; one coroutine does it all in one trip.
    """
    from zarr.core.sync import sync

    return sync(read_flat_async(zstore, path))[0]


async def read_flat_async(zstore: Any, path: str = "params") -> tuple[FlatParams, dict[str, Any]]:
    """:func:`read_flat_at` in Zarr's event loop; with the arrays it opened (dtype -> Zarr's array)."""
    from zarr.api.asynchronous import open_group

    group = await open_group(store=zstore, mode="r", path=path)
    layout = Layout.from_dict(group.attrs[LAYOUT_KEY])
    arrays, opened = {}, {}
    for dtype in layout.sizes:
        arr: Any = await group.getitem(dtype)
        arrays[dtype] = _from_numpy(np.asarray(await arr.getitem(slice(None))), dtype)
        opened[dtype] = arr
    return FlatParams(layout, arrays), opened


def plain_chunk(meta: Any) -> int | None:
    """The chunk length of a 1-d array whose chunks are their values' little-endian bytes and nothing
    else (how :func:`write_flat` stores its arrays), from its Zarr metadata; None for any other array."""
    from zarr.codecs import BytesCodec

    codecs = tuple(getattr(meta, "codecs", ()))
    grid = getattr(getattr(meta, "chunk_grid", None), "chunk_shape", None)
    if len(codecs) != 1 or not isinstance(codecs[0], BytesCodec) or grid is None or len(grid) != 1:
        return None
    if len(meta.shape) != 1:
        return None
    endian = getattr(codecs[0].endian, "value", codecs[0].endian)
    return int(grid[0]) if endian in (None, "little") else None


def _to_numpy(values: torch.Tensor, dtype: str) -> tuple[np.ndarray, np.dtype]:
    if dtype == "bfloat16":
        values = values.view(torch.uint16)
    data = values.numpy()
    return data, data.dtype


def _from_numpy(data: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(data))
    return t.view(torch_dtype(dtype)) if dtype == "bfloat16" else t
