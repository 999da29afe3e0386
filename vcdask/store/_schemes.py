"""Which backend serves a location: :data:`BACKENDS` (URL scheme -> backend class) and :func:`backend_for`.

:func:`vcdask.store.open_store` and the credential checks (:mod:`._credentials`) look a location up
here; the backends themselves are in :mod:`._local`, :mod:`._memory` and :mod:`._object`.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidLocationError
from ._backend import StoreBackend
from ._local import LocalBackend
from ._memory import MemoryBackend
from ._object import AzureBackend, GCSBackend, S3Backend
from ._secret_options import mask_userinfo

__all__ = ["BACKENDS", "MODES", "backend_for", "scheme_of"]

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
#: The modes a store opens with (see :func:`vcdask.store.open_store`).
MODES = ("r", "r+", "a", "w-")


def scheme_of(location: str) -> str:
    """The URL scheme of ``location``, lower-cased (``"file"`` for a plain path).

    Parameters
    ----------
    location : str

    Returns
    -------
    str
    """
    return location.split("://", 1)[0].lower() if "://" in location else "file"


def backend_for(location: str | os.PathLike, mode: str, storage_options: dict[str, Any]) -> StoreBackend:
    """The backend for a store at ``location``, opened with ``mode`` (both checked).

    Parameters
    ----------
    location : str or path-like
        The store's location (a path, or a URL with a scheme of :data:`BACKENDS`).
    mode : str
        One of :data:`MODES`.
    storage_options : dict
        The backend's options (it checks them).

    Returns
    -------
    StoreBackend

    Raises
    ------
    TypeError
        ``location`` is neither a str nor path-like.
    InvalidLocationError
        A bad mode, an empty location, an unknown scheme, or options the backend does not take.
    """
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
    scheme = scheme_of(location)
    backend_cls: type[StoreBackend] | None = BACKENDS.get(scheme)
    if backend_cls is None:
        raise InvalidLocationError(
            f"unsupported store location scheme {scheme!r} in {mask_userinfo(location)!r}; "
            f"supported schemes: {sorted(BACKENDS)} (or a local path)"
        )
    return backend_cls(location, storage_options)
