"""Local-directory backend: an Icechunk repository in a folder, commits serialised by a file lock."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import InvalidLocationError, StoreAccessDeniedError, StoreError, StoreNotFoundError
from ._errors import quiet_logs
from ._secret_options import mask_userinfo

__all__ = ["LocalBackend"]

logger = logging.getLogger(__name__)

_LOCK_NAME = ".vcdask-commit.lock"


class LocalBackend:
    """A store in a local directory (any POSIX filesystem, including shared NFS mounts with flock)."""

    scheme = "file"
    shared_across_processes = True
    durable = True
    locked_commits = True  # every commit holds the directory's file lock (and so does a collection)
    client_per_storage = False  # files, no client to configure
    secret_options: frozenset[str] = frozenset()

    def __init__(self, location: str, options: dict[str, Any]):
        if options:
            raise InvalidLocationError(
                f"storage options {sorted(options)} do not apply to the local directory {location!r}; "
                "local stores take no storage options"
            )
        self.path = Path(local_path(location)).expanduser().absolute()
        self.location = str(self.path)
        self.options: dict[str, Any] = {}

    def describe(self) -> str:
        return f"local directory {self.location!r}"

    def storage(self):
        import icechunk

        quiet_logs()  # (also Icechunk's warning that local storage is unsafe for concurrent commits:
        # vcdask serialises them with a file lock)
        return icechunk.local_filesystem_storage(self.location)

    def preflight(self, mode: str) -> None:
        """Check the path before Icechunk looks at it (it panics on a file, also on one above the path, and
        creates missing folders: it panics where it may not)."""
        try:
            exists = self.path.exists()
            above = None if exists else next((p for p in self.path.parents if p.exists()), None)
        except OSError as e:  # e.g. a folder above that this user may not search
            raise _fault(e, f"opening {self.describe()}", writing=False) from None
        if exists and not self.path.is_dir():
            raise StoreNotFoundError(f"{self.location!r} is a file, not a vcdask store")
        if above is not None and not above.is_dir():  # the nearest existing path above it
            raise StoreNotFoundError(
                f"no vcdask store can be at {self.location!r}: {str(above)!r} is a file, not a directory"
            )
        if above is not None and mode in ("a", "w-") and not os.access(above, os.W_OK):  # (Icechunk panics too)
            raise StoreAccessDeniedError(
                f"cannot create a store at {self.describe()}: {str(above)!r} may not be written (a read-only "
                "filesystem, or permissions)"
            )
        if mode in ("r", "r+") and not exists:
            raise StoreNotFoundError(
                f"no vcdask store at {self.describe()} (mode={mode!r} opens existing stores only; "
                "use mode='a' to create one)",
                location=self.describe(),
                mode=mode,
            )

    def check_creatable(self) -> None:
        """Refuse to create a store inside a non-empty directory that is not a store."""
        if self.path.is_dir() and any(p.name != _LOCK_NAME for p in self.path.iterdir()):
            raise StoreNotFoundError(
                f"{self.location!r} exists but is not a vcdask store (it holds other files and no "
                "Icechunk repository); give a new or empty directory, or the path of an existing store"
            )

    def filesystem(self, max_tries: int = 5, *, asynchronous: bool = False):
        """An fsspec filesystem and root path for the store's side files (run specs, updates)."""
        from fsspec.implementations.local import LocalFileSystem

        fs = LocalFileSystem(auto_mkdir=True)
        if asynchronous:
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            fs = AsyncFileSystemWrapper(fs, asynchronous=True)
        return fs, self.location

    @contextlib.contextmanager
    def create_lock(self) -> Iterator[None]:
        """An exclusive lock on the parent directory: other creators (threads, processes) wait, then open
        what the first created.  Not a file in the store's directory: Icechunk creates only in an empty one."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path.parent, os.O_RDONLY)
        except OSError as e:
            raise _fault(e, f"creating a store at {self.describe()}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:  # a filesystem without directory locks: a lost race is then retried as an open
                logger.debug("no lock on %s (%s); creating without it", self.path.parent, e)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def commit_lock(self) -> Iterator[None]:
        """An exclusive lock across threads and processes; released by the kernel if the holder dies.

        Raises
        ------
        StoreAccessDeniedError
            The lock file cannot be written: a read-only filesystem, or a directory this user may not write.
        StoreError
            Any other fault of the lock (its path is not a file, a filesystem without locks).
        """
        lock = self.path / _LOCK_NAME
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _fault(e, f"taking the commit lock {str(lock)!r} of {self.describe()}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                raise _fault(e, f"taking the commit lock {str(lock)!r} of {self.describe()}") from None
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock


def local_path(location: str) -> str:
    """The path of a local store's ``location``: a path as given, or the path of a ``file://`` URL.

    A URL's path is percent-decoded (``Path.as_uri()`` gives ``file:///my%20runs``), its scheme is
    case-insensitive, and its host must be empty or ``localhost``.

    Raises
    ------
    InvalidLocationError
        A URL naming another host, or with no path, a query or a fragment (``?`` and ``#`` in a path
        are written ``%3F`` and ``%23``).
    """
    if "://" not in location:
        return location
    url = urlsplit(location)
    if url.netloc not in ("", "localhost"):
        shown = mask_userinfo(location)  # (user:secret@host: never echoed)
        raise InvalidLocationError(
            f"the file URL {shown!r} names the host {urlsplit(shown).netloc!r}; a local store's URL names no host or "
            "'localhost' (file:///abs/path, file://localhost/abs/path): give a path on this machine"
        )
    if url.query or url.fragment or location.endswith(("?", "#")):
        raise InvalidLocationError(
            f"the file URL {location!r} has a query or fragment; write '?' and '#' of the path as '%3F' and "
            "'%23' (pathlib.Path.as_uri() does), or give the path itself"
        )
    if not url.path:
        raise InvalidLocationError(f"the file URL {location!r} has no path; give file:///abs/path")
    return unquote(url.path)


def _fault(e: OSError, what: str, *, writing: bool = True) -> StoreError:
    """The store error for a local filesystem call that failed (``what``: what was being done, ``writing``:
    for a write); one refused (a read-only filesystem, or permissions) is a :class:`StoreAccessDeniedError`."""
    if isinstance(e, PermissionError) or e.errno == errno.EROFS:
        hint = "; to read the store only, open it with mode='r'" if writing else ""
        return StoreAccessDeniedError(f"{what}: {e}{hint}")
    return StoreError(f"{what}: {e}")
