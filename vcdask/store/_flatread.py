"""Reading a version's flat parameters in one round of requests, once a read has seen their layout.

A run's versions share one layout, so every read after the first asks for the same keys: the group's
and each array's ``zarr.json`` and the arrays' chunks.  :func:`read_flat` asks for all of them at
once (one trip to Zarr's event loop, the requests concurrent), and keeps what it got only if both
metadata documents are byte for byte the ones the previous read found: then the chunks it asked for
are the version's chunks.  Anything else (a first read, a new layout, another chunking, a codec
other than plain little-endian bytes) goes through Zarr (:func:`~._layout.read_flat_async`).

Zarr's own read (open the group, then each array, then its chunks) waits for each request before
it makes the next: on two busy cores a small model's read (digits' CNN) took 6-7 ms of a worker's
task in a run, against under 3 ms alone, as each request hands over to Icechunk's I/O threads and
back.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..params import FlatParams, Layout
from ._checksum import Hasher
from ._layout import _from_numpy, plain_chunk, read_flat_async

__all__ = ["Seen", "read_flat"]


@dataclass(frozen=True)
class _Array:
    dtype: str  # the layout's dtype name (the array's name in the group)
    doc: bytes  # its zarr.json
    numpy_dtype: np.dtype
    size: int
    chunk: int
    fill: Any
    keys: tuple[str, ...]  # its chunks, in order


@dataclass(frozen=True)
class Seen:
    """What a read of a flat group found: its metadata documents, layout and chunk keys."""

    doc: bytes  # the group's zarr.json
    layout: Layout
    arrays: tuple[_Array, ...]


def read_flat(zstore: Any, seen: dict[str, Seen], path: str = "params", hasher: Hasher | None = None) -> FlatParams:
    """The flat parameters in the group at ``path`` of ``zstore``; ``seen`` (path -> :class:`Seen`,
    owned by the caller and updated here) remembers what the last read at ``path`` found.  ``hasher``
    is fed each array's bytes as they are filled in (the checksums then overlap the read; a read through
    Zarr feeds it nothing, and :func:`~._checksum.verify` hashes afterwards)."""
    from zarr.core.sync import sync

    last = seen.get(path)
    if last is not None:
        flat = sync(_read_as(zstore, last, path, hasher))
        if flat is not None:
            return flat
    flat, now = sync(_read_and_see(zstore, path))
    if now is None:
        seen.pop(path, None)
    else:
        seen[path] = now
    return flat


async def _get(zstore: Any, key: str) -> Any:
    from zarr.core.buffer import default_buffer_prototype

    return await zstore.get(key, default_buffer_prototype())


async def _read_as(zstore: Any, last: Seen, path: str, hasher: Hasher | None = None) -> FlatParams | None:
    """The group's parameters if its metadata is still ``last``'s, in one round of requests; else None.

    Each chunk is copied into place (and handed to ``hasher``) as it arrives, while the others are on
    their way: waiting for all of them first made a 400 MB read 1.5x as long as Zarr's own."""
    docs = [f"{path}/zarr.json", *(f"{path}/{a.dtype}/zarr.json" for a in last.arrays)]
    outs = {a.dtype: np.empty(a.size, dtype=a.numpy_dtype) for a in last.arrays}

    async def chunk(a: _Array, i: int, key: str) -> None:
        buf = await _get(zstore, key)
        out = outs[a.dtype]
        part = out[i * a.chunk : (i + 1) * a.chunk]
        if buf is None:  # a chunk never written holds the fill value
            part[:] = a.fill
            data = part.view(np.uint8)
        else:
            data = buf.as_numpy_array().view(np.uint8)[: part.nbytes]
        if hasher is not None:  # hashed on the pool's threads while the chunks are copied here
            hasher.add(a.dtype, i * a.chunk * out.itemsize, data)
        if buf is not None:
            part[:] = np.frombuffer(data, dtype=a.numpy_dtype, count=len(part))

    got_docs, got_chunks = await asyncio.gather(
        asyncio.gather(*(_get(zstore, key) for key in docs), return_exceptions=True),
        asyncio.gather(*(chunk(a, i, k) for a in last.arrays for i, k in enumerate(a.keys)), return_exceptions=True),
    )
    for buf, want in zip(got_docs, (last.doc, *(a.doc for a in last.arrays)), strict=True):
        if buf is None or isinstance(buf, BaseException) or buf.to_bytes() != want:
            return None  # (Icechunk raises for the metadata of an array this version does not have)
    for problem in got_chunks:
        if isinstance(problem, BaseException):  # the version is the one we know: a chunk that did not come fails
            raise problem
    if hasher is not None:  # the bytes are the version's: their checksums count (not marked, they do not)
        for a in last.arrays:
            hasher.finish(a.dtype)
    return FlatParams(last.layout, {d: _from_numpy(out, d) for d, out in outs.items()})


async def _read_and_see(zstore: Any, path: str) -> tuple[FlatParams, Seen | None]:
    """Zarr's read of the group, and what the next read may take as known (None: nothing)."""
    flat, opened = await read_flat_async(zstore, path)
    arrays = [_plain(arr, dtype, path) for dtype, arr in opened.items()]
    if any(a is None for a in arrays):
        return flat, None
    keys = (f"{path}/zarr.json", *(f"{path}/{a.dtype}/zarr.json" for a in arrays if a is not None))
    docs = await asyncio.gather(*(_get(zstore, key) for key in keys))
    if any(d is None for d in docs):
        return flat, None
    return flat, Seen(
        docs[0].to_bytes(),
        flat.layout,
        tuple(replace(a, doc=d.to_bytes()) for a, d in zip(arrays, docs[1:], strict=True) if a is not None),
    )


def _plain(arr: Any, dtype: str, path: str) -> _Array | None:
    """How to read an array stored as plain little-endian bytes in 1-d chunks (its ``doc`` still to
    fill in); None for any other array (Zarr reads those)."""
    meta = arr.metadata
    chunk = plain_chunk(meta)
    numpy_dtype = np.dtype(arr.dtype)
    if chunk is None or (numpy_dtype.itemsize > 1 and sys.byteorder != "little"):
        return None
    size = int(arr.shape[0])
    keys = tuple(f"{path}/{dtype}/{meta.encode_chunk_key((i,))}" for i in range(-(-size // chunk)))
    return _Array(dtype, b"", numpy_dtype.newbyteorder("="), size, chunk, meta.fill_value, keys)
