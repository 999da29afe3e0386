"""A small model's parameters as plain bytes in a Dask message.

The run's answer that gives a shard task its base (the version it trains from) can carry that
version's parameters when they are small (``vcdask.worker.inline-base-bytes``): the worker then
keeps them as if it had read them, and skips a store read that costs a small model more than its
bytes (an Icechunk session, Zarr's metadata and chunk requests: 7 ms in a run for digits' CNN of
150 kB, where the message takes a fraction of a millisecond).  The merge thread packs the copy (at
a commit, or as it merges: ``vcdask.worker.base-before-commit``), so the event loop only passes
``bytes`` along.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import ParameterMismatchError
from .params import FlatParams, Layout, torch_dtype

__all__ = ["pack", "unpack"]


def pack(flat: FlatParams) -> dict[str, Any]:
    """``flat`` as msgpack-able values: its layout as a dict, each dtype's array as ``bytes`` (a copy)."""
    arrays = {d: a.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() for d, a in flat.arrays.items()}
    return {"layout": flat.layout.to_dict(), "arrays": arrays}


def unpack(payload: dict[str, Any]) -> FlatParams:
    """The :class:`~vcdask.params.FlatParams` that :func:`pack` gave ``payload`` for (in memory of its own).

    Raises
    ------
    ParameterMismatchError
        The arrays do not match the layout (wrong dtypes or sizes).
    """
    arrays = {}
    for d, raw in payload["arrays"].items():
        dtype = torch_dtype(d)
        buf = bytearray(raw)  # writable and owned: the worker loads it into its model
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if len(buf) % itemsize:
            raise ParameterMismatchError(
                f"{len(buf)} bytes are not a whole number of {d} values ({itemsize} bytes each)"
            )
        arrays[d] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype) if buf else torch.empty(0, dtype=dtype)
    return FlatParams(Layout.from_dict(payload["layout"]), arrays)
