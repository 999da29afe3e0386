"""Plain objects beside a store's Icechunk repository: run specifications and client updates.

They live under ``<store>/runs/<run_id>/``; Icechunk never reads or deletes them.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

import numpy as np
from fsspec.implementations.local import LocalFileSystem
from zarr.storage import FsspecStore

from ..errors import ReadOnlyStoreError, StoreAccessDeniedError, StoreError
from ._secrets import redact

__all__ = ["FilesOwner", "SideFiles"]


class FilesOwner(Protocol):
    """What :class:`SideFiles` needs of its store (a :class:`~vcdask.store.ParamStore`): its side files.

    A Zarr store of the side files pickles as its owner and a path, and reopens through the owner's
    :attr:`files` where it is unpickled.
    """

    @property
    def files(self) -> SideFiles:
        """The owner's side files."""


def _modified(info: Mapping[str, Any]) -> float | None:
    """When an object was last written (POSIX seconds), from an fsspec ``info`` dict: ``mtime`` (local),
    ``LastModified`` (s3fs), ``last_modified`` (adlfs), ``updated`` (gcsfs), ``created`` (memory)."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                when = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    return None


#: What a local write's temporary file is called while it is written: ``.<name>.<hex>.part`` beside the object.
#: An object store's PUT replaces an object whole; a local file written in place is first truncated, so a
#: reader of a run's record, a spec or an update (a resume, the panel, the merge thread) could read it empty.
_PART = ".part"


def _is_part(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith(".") and name.endswith(_PART)


def write_whole(full: str | os.PathLike, parts: Sequence[bytes | memoryview]) -> int:
    """Write ``parts`` to the local file ``full`` whole or not at all: into a temporary file beside it,
    then renamed over it (``os.replace`` is atomic on one filesystem).  Return the size written.  A link
    is written through (renamed over, the link itself would be replaced)."""
    target = os.path.realpath(full)
    folder, name = os.path.split(target)
    os.makedirs(folder, exist_ok=True)
    part = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:12]}{_PART}")
    try:
        with open(part, "wb") as f:
            n = sum(f.write(piece) for piece in parts)
        _keep_mode(target, part)
        os.replace(part, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(part)
        raise
    return n


def _keep_mode(old: str | os.PathLike, new: str | os.PathLike) -> None:
    """Give the file ``new``, about to be renamed over ``old``, ``old``'s permissions (a file written in place kept
    its own: one a user made private, 0600, stays private); nothing when there is no ``old``."""
    try:
        mode = os.stat(old).st_mode
    except FileNotFoundError:
        return
    os.chmod(new, stat.S_IMODE(mode))


def _fault(e: OSError, what: str) -> StoreError:
    """A store error for a storage request that failed (a refused credential is not transient); no secret shown.

    Raise it ``from None``: the original error (an SDK's, e.g. one quoting a signed URL) is left out of the
    traceback, whose cause would show it unredacted."""
    if isinstance(e, StoreError):
        return e
    if isinstance(e, PermissionError) or e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        # (refused: a read-only filesystem, or permissions; as :func:`~._local._fault` says for the store itself)
        return StoreAccessDeniedError(redact(f"{what}: {e}"))
    return StoreError(redact(f"{what}: {e}"))


class SideFiles:
    """put / get / delete / list of whole objects, through fsspec, one request each; Zarr groups beside them.

    Parameters
    ----------
    fs : fsspec.AbstractFileSystem
        The filesystem (it may hold the store's credentials: it is never pickled).
    root : str
        The side files' root path in ``fs`` (``<store>/runs``).
    where : str
        The store in words, for messages.
    writable : bool, default True
    store : FilesOwner, optional
        The store these files belong to (a :class:`~vcdask.store.ParamStore`); :meth:`zarr_store` needs it.
    async_fs : callable, optional
        Makes an asynchronous filesystem like ``fs`` (for :meth:`zarr_store`).
    """

    def __init__(
        self,
        fs: Any,
        root: str,
        where: str,
        *,
        writable: bool = True,
        store: FilesOwner | None = None,
        async_fs: Callable[[], Any] | None = None,
    ):
        self.fs = fs
        self.root = root
        self.where = where
        self.writable = writable
        self.store = store
        self._make_async_fs = async_fs
        self._async_fs: Any = None
        self._zarr_stores: dict[tuple[str, bool], FsspecStore] = {}
        self._lock = threading.Lock()

    def _path(self, path: str) -> str:
        return f"{self.root}/{path.lstrip('/')}"

    def _local(self, path: str) -> str | None:
        """The file system path of ``path`` on a local store (None elsewhere)."""
        return self.fs._strip_protocol(self._path(path)) if isinstance(self.fs, LocalFileSystem) else None

    def put(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (relative to ``<store>/runs``), replacing any object there."""
        self.put_parts(path, [data])

    def put_parts(self, path: str, parts: Sequence[bytes | memoryview]) -> int:
        """Write the concatenation of ``parts`` to ``path`` (as :meth:`put`); return its size.

        A reader sees the old object or the new one, never a part of it. A local file is written piece by
        piece into a temporary file beside it (hidden from :meth:`list`), then renamed over it; elsewhere
        the pieces are joined into one request.
        """
        if not self.writable:
            raise ReadOnlyStoreError(f"cannot write {path!r} to {self.where}: it was opened with mode='r'")
        full = self._local(path)
        try:
            if full is not None:
                return write_whole(full, parts)
            data = b"".join(parts)
            self.fs.pipe_file(self._path(path), data)
            return len(data)
        except OSError as e:
            raise _fault(e, f"writing {path!r} to {self.where}") from None

    def get(self, path: str) -> bytes:
        """Read the object at ``path``; FileNotFoundError if it does not exist."""
        try:
            return self.fs.cat_file(self._path(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"no object {path!r} in {self.where}") from None
        except OSError as e:
            raise _fault(e, f"reading {path!r} from {self.where}") from None

    def get_buffer(self, path: str) -> memoryview:
        """Read the object at ``path`` into new writable memory; FileNotFoundError if it does not exist.

        A local file is read straight into the buffer (uninitialised memory: ``bytearray(n)`` wrote
        zeros over it first, 15% of the merge thread's time in ``benchmarks/merge_bound.py``);
        ``bytearray(get(path))`` copies the bytes once more, and for a 20 MB update that copy took
        ten times the read (measured in ``benchmarks/merge_path.py``: 20 ms against 2 ms).
        """
        full = self._local(path)
        try:
            if full is None:
                return memoryview(bytearray(self.fs.cat_file(self._path(path))))
            with open(full, "rb") as f:
                buf = np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8)
                n = f.readinto(buf.data)
            return buf.data if n == len(buf) else buf.data[:n]
        except FileNotFoundError:
            raise FileNotFoundError(f"no object {path!r} in {self.where}") from None
        except OSError as e:
            raise _fault(e, f"reading {path!r} from {self.where}") from None

    def get_many(self, paths: Sequence[str]) -> dict[str, bytes]:
        """Read the objects at ``paths`` at once (concurrent requests on an object store); those not there are
        left out."""
        if not paths:
            return {}
        strip = self.fs._strip_protocol
        try:
            found = self.fs.cat([self._path(p) for p in paths], on_error="omit")
        except OSError as e:
            raise _fault(e, f"reading {len(paths)} objects from {self.where}") from None
        found = {strip(k): v for k, v in found.items()}
        return {p: found[strip(self._path(p))] for p in paths if strip(self._path(p)) in found}

    def folders(self) -> list[str]:
        """The names of the folders right under ``<store>/runs`` (one per run, and the store's own)."""
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _fault(e, f"listing the runs of {self.where}") from None
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

    def nbytes(self, path: str) -> int | None:
        """Bytes of every object under ``path`` (a folder, or one object); None when there is nothing there."""
        try:
            found = self.fs.find(self._path(path), detail=True)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _fault(e, f"sizing {path!r} in {self.where}") from None
        return sum(int(info.get("size") or 0) for info in found.values()) if found else None

    def delete_tree(self, path: str) -> None:
        """Remove ``path`` and everything under it, if there is anything."""
        if not self.writable:
            raise ReadOnlyStoreError(f"cannot delete {path!r} from {self.where}: it was opened with mode='r'")
        try:
            self.fs.rm(self._path(path), recursive=True)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _fault(e, f"deleting {path!r} from {self.where}") from None
        with self._lock:  # (a Zarr store of the group opened here would list what is gone)
            for key in [k for k in self._zarr_stores if k[0] == path]:
                del self._zarr_stores[key]

    def exists(self, path: str) -> bool:
        try:
            return self.fs.exists(self._path(path))
        except OSError as e:
            raise _fault(e, f"looking for {path!r} in {self.where}") from None

    def delete(self, path: str) -> None:
        """Remove ``path`` if it exists."""
        try:
            self.fs.rm_file(self._path(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _fault(e, f"deleting {path!r} from {self.where}") from None

    def list(self, prefix: str, *, written_before: float | None = None, parts: bool = False) -> list[str]:
        """Paths (relative to ``<store>/runs``) of the objects under ``prefix``; with ``written_before``
        (POSIX seconds), only those last modified before then (an object whose time the filesystem does
        not give is left out).  ``parts``: with the temporary files of local writes (:meth:`put_parts`),
        for a caller that deletes what it lists, such as those a killed writer left."""
        base = self._path(prefix).rstrip("/")
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _fault(e, f"listing {prefix!r} in {self.where}") from None
        if written_before is not None:
            found = {p: info for p, info in found.items() if (_modified(info) or math.inf) < written_before}
        strip = len(self.root.strip("/")) + 1
        return sorted(p.strip("/")[strip:] for p in found if parts or not _is_part(p))

    def url(self, path: str) -> str:
        """The URL of ``path`` (relative to ``<store>/runs``), for messages and cache keys; no credentials in it."""
        return self.fs.unstrip_protocol(self._path(path))

    def zarr_store(self, path: str, *, read_only: bool = False) -> FsspecStore:
        """A Zarr store for the group at ``path`` (relative to ``<store>/runs``), e.g. staged training data.

        It pickles as this side-files' store and ``path`` (so without secrets): unpickled in another
        process it reopens there with that process's credentials.  One object per path in a process.
        """
        if self.store is None or self._make_async_fs is None:
            raise TypeError(f"the side files of {self.where} were made without their store; they cannot open Zarr")
        if not read_only and not self.writable:
            raise ReadOnlyStoreError(f"cannot write {path!r} to {self.where}: it was opened with mode='r'")
        with self._lock:
            found = self._zarr_stores.get((path, read_only))
            if found is None:
                if self._async_fs is None:
                    self._async_fs = self._make_async_fs()
                found = _SideZarrStore(fs=self._async_fs, path=self._path(path), read_only=read_only)
                found.side = (self.store, path)
                self._zarr_stores[(path, read_only)] = found
            return found


class _SideZarrStore(FsspecStore):
    """An fsspec Zarr store that pickles as (parameter store, path): never its filesystem's credentials."""

    side: tuple[FilesOwner, str]

    def __reduce__(self):
        return (_side_zarr_store, (*self.side, self.read_only))

    def with_read_only(self, read_only: bool = False) -> FsspecStore:
        return _side_zarr_store(*self.side, read_only)


def _side_zarr_store(store: FilesOwner, path: str, read_only: bool) -> FsspecStore:
    return store.files.zarr_store(path, read_only=read_only)
