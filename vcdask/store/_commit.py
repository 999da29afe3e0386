"""Committing one version to an Icechunk-backed store (:meth:`IcechunkParamStore.commit`).

A run commits after (almost) every merge, so this path is kept short.  When the branch head is the
version this store object committed last, with the same parameter layout, the arrays are known to be
there with the right shapes: their chunks are overwritten (:func:`rewrite_flat`), without opening the
root group, listing the arrays or rewriting attributes, without reading again the Zarr metadata read
for the previous commit, and without looking for the rule state that versions of earlier vcdask
releases kept inside the version.  For a small model these reads were most of a commit's time.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import StoreConflict
from ..params import FlatParams
from . import _checksum
from ._base import check_metadata
from ._checksum import CHECKSUM_KEY, STATE_CHECKSUM_KEY
from ._errors import translate
from ._history import is_reserved
from ._layout import FORMAT, FORMAT_KEY, plain_chunk, write_flat, write_state
from ._names import NamedStore
from ._needs import KEEP_FROM_KEY
from ._state import STATE_KEY, delete_state

if TYPE_CHECKING:
    from ._files import SideFiles
    from ._state import StateWriter

logger = logging.getLogger(__name__)

__all__ = ["CommitStore", "LastCommit", "commit_version", "rewrite_flat"]


@dataclass(frozen=True)
class LastCommit:
    """What a store object committed last on a branch (the fast path of :func:`commit_version`)."""

    version: str
    layout: dict
    #: the version's metadata (which rule state object it names)
    metadata: dict
    #: dtype -> the Zarr metadata of its array (chunks, codecs, chunk keys), as read for this commit
    arrays: dict[str, Any] = field(default_factory=dict)


class CommitStore(NamedStore, Protocol):
    """What a commit uses of an Icechunk-backed store (:class:`~vcdask.store.IcechunkParamStore`),
    besides its repository and backend (:class:`~._names.NamedStore`).

    Attributes
    ----------
    chunk_bytes : int
        Chunk size of the stored flat arrays.
    commit_retries : int
        Retries of a commit that lost a race with another writer.
    _state_writer : StateWriter
        The writer of the rule state objects.
    _last_commit : dict of str to LastCommit
        Branch -> what this store object committed there last.
    """

    chunk_bytes: int
    commit_retries: int
    _state_writer: StateWriter
    _last_commit: dict[str, LastCommit]

    @property
    def files(self) -> SideFiles:
        """The store's side files (the rule state objects live there)."""

    def describe(self) -> str:
        """The store's location in words, for messages."""


def commit_version(
    store: CommitStore,
    flat: FlatParams,
    metadata: Any,
    branch: str,
    message: str | None,
    parent: str | None,
    state: Any,
    keep_from: int | None,
) -> str:
    """Commit ``flat`` on ``branch``; see :meth:`IcechunkParamStore.commit` for the arguments."""
    import icechunk

    if is_reserved(branch):  # (a pin moved by a commit would keep another version than its name says)
        raise ValueError(f"branch names starting with 'vcdask.keep.' or 'vcdask.hold.' belong to vcdask: {branch!r}")
    meta = {**check_metadata(metadata), FORMAT_KEY: FORMAT}
    if keep_from is not None:
        meta[KEEP_FROM_KEY] = int(keep_from)
    what = f"committing to branch {branch!r} of {store.describe()}"
    layout = flat.layout.to_dict()
    checksum = _checksum.start(flat)  # on threads, while the chunks are written (recorded with the version)
    state_checksums = {name: _checksum.start(value) for name, value in (state or {}).items()} if checksum else {}
    for attempt in range(store.commit_retries + 1):
        with store._backend.commit_lock():
            try:
                session = store._repo.writable_session(branch)
            except icechunk.IcechunkError as e:
                raise _unsent(store._ref_error(e, branch=branch)) from None
            if parent is not None:
                head = store._version_or_none(session.snapshot_id)
                if head != parent:
                    raise StoreConflict(
                        f"{what}: expected the branch head to be {parent!r} but it is {head!r}; nothing was written"
                    )
            written = None  # what this attempt wrote of the rule state
            if state and STATE_KEY not in meta:  # first: a version never names a state object that is not there
                try:
                    meta[STATE_KEY], written = store._state_writer.write(
                        store.files, branch, session.snapshot_id, state
                    )
                except OSError as e:
                    _unsent(e)
                    raise
            sent = False  # whether the commit itself was sent (it may have landed although it failed)
            try:
                last = store._last_commit.get(branch)
                arrays: dict[str, Any] = {}
                if last is not None and last.version == session.snapshot_id and last.layout == layout:
                    # our own head, same layout: the arrays are there (a memory store keeps the bytes it is
                    # given, so it gets a copy, not a view of parameters the run goes on changing)
                    arrays = rewrite_flat(session.store, flat, copy=not store._backend.durable, known=last.arrays)
                    replaced = last.metadata
                else:
                    write_flat(session.store, flat, store.chunk_bytes)
                    write_state(session.store, None, store.chunk_bytes)  # (earlier vcdask kept it inside)
                    replaced = store._repo.lookup_snapshot(session.snapshot_id).metadata or {}
                if checksum is not None:
                    meta[CHECKSUM_KEY] = checksum.result()
                if state_checksums:
                    meta[STATE_CHECKSUM_KEY] = {name: c.result() for name, c in state_checksums.items() if c}
                sent = True
                version = session.commit(message or "vcdask version", metadata=meta)
            except BaseException as e:  # nothing of this store's last commit is known to hold any more
                store._last_commit.pop(branch, None)
                store._state_writer.forget(branch)
                if isinstance(e, icechunk.ConflictError) and parent is None:
                    meta.pop(STATE_KEY, None)  # written again (in full) for the next attempt
                    logger.debug("commit to %r lost a race (attempt %d); retrying", branch, attempt + 1)
                    continue
                if isinstance(e, (icechunk.ConflictError, icechunk.IcechunkError)):
                    error = translate(e, what)
                    raise (error if sent else _unsent(error)) from None
                raise
            store._last_commit[branch] = LastCommit(version, layout, meta, arrays)
            store._state_writer.committed(branch, version, written)
        # (a failed attempt leaves its state object: the branch's writer sweeps it, see ParamStore.gc)
        delete_state(store.files, replaced.get(STATE_KEY), branch, keep=meta.get(STATE_KEY))
        return version
    raise StoreConflict(f"{what}: lost the race to other writers {store.commit_retries + 1} times; nothing was written")


def _unsent(error: BaseException) -> BaseException:
    """``error``, marked as raised before the commit was sent: the version cannot have landed, so a
    caller need not look at the branch head for it (:attr:`StoreError.unsent`; under an S3 outage that
    look costs another round of the client's retries, 20-30 s)."""
    error.unsent = True  # type: ignore[attr-defined]
    return error


def rewrite_flat(
    zstore: Any, flat: FlatParams, path: str = "params", *, copy: bool = False, known: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Overwrite the arrays of a group that :func:`~._layout.write_flat` wrote with this same layout.

    Each array's Zarr metadata is read (and its shape and dtype checked) unless ``known`` has it
    (dtype -> metadata, as this function returned it for the previous version); the root group, the
    listing of the group and its layout attribute are left as they are.  The chunks are written as
    they are stored (:func:`_put_chunks`), not through Zarr's write path; ``copy``: each chunk as a
    copy, for a store that keeps the bytes it is given (in memory).  Returns the metadata of the
    arrays written that way, for the next version's ``known``.
    """
    import zarr

    from ._layout import _to_numpy, write_all

    written = {}
    for dtype, values in flat.arrays.items():
        data, zdtype = _to_numpy(values, dtype)
        meta, arr = (known or {}).get(dtype), None
        if meta is None or tuple(meta.shape) != data.shape:
            arr = zarr.open_array(zstore, path=f"{path}/{dtype}", mode="r+")
            if arr.shape != data.shape or arr.dtype != zdtype:  # cannot happen with the same layout; never write wrong
                raise ValueError(f"array {path}/{dtype} is {arr.shape} {arr.dtype}, not {data.shape} {zdtype}")
            meta = arr.metadata
        if not data.size:
            continue
        if _put_chunks(zstore, f"{path}/{dtype}", meta, data, copy=copy):
            written[dtype] = meta
        else:
            write_all(arr if arr is not None else zarr.open_array(zstore, path=f"{path}/{dtype}", mode="r+"), data)
    return written


def _put_chunks(zstore: Any, path: str, meta: Any, data: np.ndarray, *, copy: bool = False) -> bool:
    """Write ``data`` into the 1-d array at ``path`` (Zarr metadata ``meta``) chunk by chunk, each
    straight from ``data``'s memory.

    An uncompressed chunk of ``write_flat``'s arrays is its values' little-endian bytes (the last one
    padded with the fill value to the chunk's size), so these are the bytes Zarr writes.  Zarr's own
    write copies each chunk twice into fresh memory (into a chunk buffer, then to ``bytes``) and
    compares it with the fill value first: a third of a 5M-parameter commit, measured with py-spy in
    ``benchmarks/merge_bound.py``.  Returns False (nothing written) for an array stored any other way.

    Icechunk keeps a view of each piece until the write is done (when this returns: the caller may
    change ``data`` then); an in-memory store keeps it for good, so ``copy`` is needed there.  At most
    zarr's ``async.concurrency`` pieces are written at a time, as zarr's own write does.
    """
    import zarr
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    chunk = plain_chunk(meta)
    little = data.dtype.byteorder == "|" or (data.dtype.byteorder in "<=" and sys.byteorder == "little")
    if chunk is None or not little or data.ndim != 1:
        return False
    raw_set = getattr(getattr(zstore, "_store", None), "set", None)  # Icechunk's: any bytes-like value, no copy
    whole = memoryview(data.data).cast("B")
    width = chunk * data.dtype.itemsize
    pieces = []
    for i in range(-(-data.size // chunk)):
        piece: Any = whole[i * width : (i + 1) * width]
        if len(piece) < width:  # the last chunk, stored at full size
            padded = np.full(chunk, meta.fill_value, dtype=data.dtype)
            padded[: len(piece) // data.dtype.itemsize] = data[i * chunk :]
            piece = memoryview(padded.data).cast("B")
        pieces.append((f"{path}/{meta.encode_chunk_key((i,))}", bytes(piece) if copy else piece))
    limit = asyncio.Semaphore(max(1, int(zarr.config.get("async.concurrency") or 10)))

    async def put(key: str, piece: Any) -> None:
        async with limit:
            if raw_set is not None:
                await raw_set(key, piece)
            else:
                await zstore.set(key, default_buffer_prototype().buffer.from_bytes(bytes(piece)))

    async def put_all() -> None:
        await asyncio.gather(*(put(key, piece) for key, piece in pieces))

    sync(put_all())
    return True
