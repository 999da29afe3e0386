"""Local-directory backend: an Icechunk repository in a folder, commits serialised by a file lock."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import InvalidLocationError, StoreNotFoundError
from ._errors import quiet_logs

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
        path = location[len("file://") :] if location.startswith("file://") else location
        self.path = Path(path).expanduser().absolute()
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
        """Check the path before Icechunk looks at it (it panics on a file and creates missing folders)."""
        if self.path.exists() and not self.path.is_dir():
            raise StoreNotFoundError(f"{self.location!r} is a file, not a vcdask store")
        if mode in ("r", "r+") and not self.path.exists():
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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.parent, os.O_RDONLY)
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
        """An exclusive lock across threads and processes; released by the kernel if the holder dies."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock
