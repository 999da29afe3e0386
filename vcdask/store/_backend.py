"""What a storage backend gives :class:`~vcdask.store.IcechunkParamStore`.

One backend per kind of location (``_local``, ``_memory``, ``_object``); each only knows
how to reach its storage.  Versions, history and errors live in the store, once.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import icechunk
    from fsspec import AbstractFileSystem

__all__ = ["StoreBackend"]


@runtime_checkable
class StoreBackend(Protocol):
    """The interface of a storage backend (local directory, memory, S3, GCS, Azure).

    Attributes
    ----------
    scheme : str
        The URL scheme it serves (``"file"``, ``"memory"``, ``"s3"`` ...).
    location : str
        The store's location as given (normalised for local paths).
    shared_across_processes : bool
        Whether other processes (Dask workers) can open the same store from ``location``.
    durable : bool
        Whether the data outlives the process that wrote it.
    locked_commits : bool
        Whether every vcdask commit holds :meth:`commit_lock` (a real lock), so that a collection
        holding it never deletes the chunks of another writer's commit in progress.
    client_per_storage : bool
        Whether Icechunk reaches the storage through a client that it builds at the storage's first
        request and keeps (S3): the store then uses a fresh in-memory copy of the repository it opened,
        whose client is built with the store's retries (``max_tries``).
    options : mapping
        The storage options, with their canonical names (aliases such as ``key`` resolved).
    secret_options : frozenset of str
        The names in ``options`` that are secrets: they are never pickled, logged or
        written into the store (see :mod:`vcdask.store._credentials`).
    """

    scheme: str
    location: str
    shared_across_processes: bool
    durable: bool
    locked_commits: bool
    client_per_storage: bool
    secret_options: frozenset[str]

    def __init__(self, location: str, options: dict[str, Any]) -> None:
        """Check ``options`` for ``location`` (raise ``InvalidLocationError`` naming the valid ones)."""

    @property
    def options(self) -> Mapping[str, Any]:
        """The storage options under their canonical names."""

    def describe(self) -> str:
        """The location in words for messages (never a secret): ``"local directory '/x'"``."""

    def preflight(self, mode: str) -> None:
        """Cheap checks before Icechunk looks at the location (fail fast with a clear message)."""

    def check_creatable(self) -> None:
        """Raise if a new store must not be created there (e.g. a directory holding other files)."""

    def storage(self) -> icechunk.Storage:
        """The Icechunk storage for the location (the provider's standard credential chain
        when ``options`` holds no credentials)."""

    def filesystem(self, max_tries: int = 5, *, asynchronous: bool = False) -> tuple[AbstractFileSystem, str]:
        """An fsspec filesystem and the store's root path in it, for the side files."""

    def commit_lock(self) -> AbstractContextManager[Any]:
        """Held around each commit: what the storage cannot arbitrate itself (a null context on object stores)."""

    def create_lock(self) -> AbstractContextManager[Any]:
        """Held while a new store is created, so that concurrent creators end up with one repository."""
