"""The versioned parameter store.

:func:`open_store` turns a location into a :class:`ParamStore`; each backend lives
in its own private module (a :class:`StoreBackend`) and stores versions in an Icechunk repository.

Credentials never travel with a store: a pickled store carries its location and non-secret
options only.  Workers and the scheduler use their own credentials (environment, profile,
instance role) or those given to them with :func:`share_credentials`; :func:`check_cluster_access`
checks before a run that they can read the store.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidLocationError
from ._backend import StoreBackend
from ._base import Checkpoint, ParamStore, VersionInfo
from ._credentials import (
    FSSPEC_SECRET_OPTIONS,
    StoreCredentials,
    check_cluster_access,
    share_credentials,
    store_holds_secrets,
)
from ._icechunk import IcechunkParamStore
from ._local import LocalBackend
from ._memory import MemoryBackend
from ._object import AzureBackend, GCSBackend, S3Backend
from ._retention import GCReport, Retention

__all__ = [
    "BACKENDS",
    "FSSPEC_SECRET_OPTIONS",
    "Checkpoint",
    "GCReport",
    "IcechunkParamStore",
    "ParamStore",
    "Retention",
    "StoreBackend",
    "StoreCredentials",
    "VersionInfo",
    "check_cluster_access",
    "open_store",
    "share_credentials",
    "store_holds_secrets",
]

#: URL scheme -> backend class.
BACKENDS: dict[str, type[StoreBackend]] = {
    "file": LocalBackend,
    "memory": MemoryBackend,
    "s3": S3Backend,
    "gs": GCSBackend,
    "gcs": GCSBackend,
    "az": AzureBackend,
    "abfs": AzureBackend,
}
MODES = ("r", "r+", "a", "w-")


def open_store(
    location: str | os.PathLike | ParamStore,
    *,
    mode: str = "a",
    chunk_bytes: int | None = None,
    commit_retries: int | None = None,
    max_tries: int | None = None,
    **storage_options: Any,
) -> ParamStore:
    """Open (or create) a versioned parameter store.

    Parameters
    ----------
    location : str, path-like or ParamStore
        A local directory (``"runs/store"`` or ``"file:///..."``), ``"memory://name"``
        (this process only), ``"s3://bucket/prefix"``, ``"gs://bucket/prefix"`` or
        ``"az://container/prefix"``.  A ParamStore is returned unchanged.
    mode : {"a", "r", "r+", "w-"}, default "a"
        ``"a"`` opens or creates; ``"r"`` opens an existing store read-only; ``"r+"``
        opens an existing store for writing; ``"w-"`` creates and fails if one exists.
    chunk_bytes : int, optional
        Chunk size of the stored flat arrays (default ``vcdask.store.chunk-bytes``).
    commit_retries : int, optional
        Retries of a commit that lost a race with another writer (default ``vcdask.store.commit-retries``).
    max_tries : int, optional
        Attempts per storage request on transient faults (default ``vcdask.store.max-tries``).  On S3,
        Icechunk 1.1.21 makes 10 tries of its own requests whatever this says (the stores guide).
    **storage_options
        Backend options.  S3: ``endpoint_url``, ``region``, ``allow_http``, ``force_path_style``,
        ``access_key_id``/``key``, ``secret_access_key``/``secret``, ``session_token``/``token``,
        ``anonymous``, ``client_kwargs`` (s3fs spelling).  Without credentials the standard
        AWS chain is used (environment, config files, instance metadata).
        GCS: ``service_account_file``, ``service_account_key``, ``application_credentials``,
        ``bearer_token``, ``anonymous``.  Azure: ``account`` (required), ``access_key``,
        ``sas_token``, ``bearer_token``.
        Secret options (S3 ``access_key_id``, ``secret_access_key``, ``session_token``; GCS
        ``service_account_key``, ``bearer_token``; Azure ``access_key``, ``sas_token``,
        ``bearer_token``) are used in this process only: a pickled copy of the store (a task
        argument, a run's spec) leaves them out and uses the credentials of the process that
        unpickles it; see :func:`share_credentials` and :func:`check_cluster_access`.

    Returns
    -------
    ParamStore

    Raises
    ------
    InvalidLocationError
        Unknown scheme or storage option (the message lists the valid ones), or a bad mode.
    StoreNotFoundError
        No store there (``mode="r"``/``"r+"``), a missing bucket, or a directory that holds something else.
    StoreAccessDeniedError
        Credentials refused.
    StoreUnreachableError
        The endpoint cannot be reached.

    Examples
    --------
    >>> store = open_store("memory://doctest")
    >>> import torch
    >>> v = store.commit(torch.nn.Linear(2, 1), {"epoch": 0})
    >>> store.read(v).metadata
    {'epoch': 0}
    """
    if isinstance(location, ParamStore):
        return location
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str):
        raise TypeError(
            f"unsupported store location type {type(location).__name__}; expected a str, an os.PathLike or a ParamStore"
        )
    if mode not in MODES:
        raise InvalidLocationError(f"invalid mode {mode!r}; valid modes: {list(MODES)}")
    if not location:
        raise InvalidLocationError("empty store location; give a directory, memory://name or s3://bucket/prefix")
    scheme = location.split("://", 1)[0].lower() if "://" in location else "file"
    backend_cls: type[StoreBackend] | None = BACKENDS.get(scheme)
    if backend_cls is None:
        raise InvalidLocationError(
            f"unsupported store location scheme {scheme!r} in {location!r}; "
            f"supported schemes: {sorted(BACKENDS)} (or a local path)"
        )
    backend = backend_cls(location, storage_options)
    return IcechunkParamStore(
        backend, mode, chunk_bytes=chunk_bytes, commit_retries=commit_retries, max_tries=max_tries
    )
