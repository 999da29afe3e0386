"""In-memory backend: a process-local Icechunk repository, shared by name within the process."""

from __future__ import annotations

import threading
from typing import Any

from ..errors import InvalidLocationError

__all__ = ["MemoryBackend"]

_registry: dict[str, tuple[Any, threading.Lock]] = {}
_registry_lock = threading.Lock()


class MemoryBackend:
    """``memory://name``: lives as long as the process; other processes cannot see it."""

    scheme = "memory"
    shared_across_processes = False
    durable = False
    locked_commits = True  # every commit holds the store's lock (and so does a collection)
    client_per_storage = False  # the storage is the process's memory: a pickled copy would be a new, empty one
    secret_options: frozenset[str] = frozenset()

    def __init__(self, location: str, options: dict[str, Any]):
        if options:
            raise InvalidLocationError(
                f"storage options {sorted(options)} do not apply to the memory store {location!r}; "
                "memory stores take no storage options"
            )
        self.name = location[len("memory://") :].strip("/")
        self.location = f"memory://{self.name}"
        self.options: dict[str, Any] = {}
        with _registry_lock:
            if self.name not in _registry:
                import icechunk

                _registry[self.name] = (icechunk.in_memory_storage(), threading.Lock())
            self._storage, self._lock = _registry[self.name]

    def describe(self) -> str:
        return f"memory store {self.location!r}"

    def storage(self):
        return self._storage

    def preflight(self, mode: str) -> None:
        return None

    def check_creatable(self) -> None:
        return None

    def filesystem(self, max_tries: int = 5, *, asynchronous: bool = False):
        """fsspec's process-local memory filesystem, under a folder named after the store."""
        from fsspec.implementations.memory import MemoryFileSystem

        fs = MemoryFileSystem()
        if asynchronous:
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            fs = AsyncFileSystemWrapper(fs, asynchronous=True)
        return fs, f"/vcdask-memory-stores/{self.name}"

    def commit_lock(self) -> threading.Lock:
        return self._lock

    def create_lock(self) -> threading.Lock:
        """The store's lock: one thread creates the repository, the others then open it."""
        return self._lock

    @staticmethod
    def forget(name: str) -> None:
        """Drop the named memory store (tests use this to free memory)."""
        with _registry_lock:
            _registry.pop(name.removeprefix("memory://").strip("/"), None)
