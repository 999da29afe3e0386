"""What a pickled copy of a store carries, and how it reopens where it is unpickled.

A store pickles as a call of ``vcdask.store._icechunk._reopen`` with ``vcdask.store.open_store``, the
location and the options of :func:`split_options`'s public half (never a secret: run specs and task
arguments hold such pickles), opened with the mode of :func:`copy_mode`.  :func:`reopen` unpickles it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._secrets import lookup_credentials

if TYPE_CHECKING:
    from ._backend import StoreBackend

__all__ = ["copy_mode", "reopen", "split_options"]

_reopened: dict[tuple, Any] = {}


def split_options(backend: StoreBackend) -> tuple[dict[str, Any], dict[str, Any]]:
    """``backend``'s options as (public, secret): what a pickled copy of the store carries, and what
    stays in this process (``backend.secret_options``; for GCS and Azure also each secret entry of
    ``config``, as ``config.<key>``).  Both under the backend's canonical names."""
    secret = backend.secret_options
    public = {k: v for k, v in backend.options.items() if k not in secret}
    return public, {k: v for k, v in backend.options.items() if k in secret}


def copy_mode(mode: str) -> str:
    """The mode a pickled copy of a store opened with ``mode`` reopens with: the same store, never a new one.

    A copy opens an existing store (``"r+"``, or ``"r"`` for a read-only original): where the store
    is missing (a worker without the shared filesystem) it says so instead of creating an empty one,
    and a copy of a store created with ``"w-"`` opens the store its original created.
    """
    return "r" if mode == "r" else "r+"


def reopen(open_store: Callable[..., Any], location: str, kwargs: dict[str, Any]) -> Any:
    """Unpickle a store: one open store per (location, options) per process (workers reuse it).

    ``kwargs`` holds no secret; the credentials registered in this process for ``location``
    (if any) are added here, else the backend falls back to the provider's standard chain.
    """
    # (a store pickled by an earlier vcdask version carries its own mode: a copy opens what exists, see copy_mode)
    kwargs = {**kwargs, "mode": copy_mode(kwargs.get("mode", "a"))}
    key = (location, repr(sorted(kwargs.items())))
    store = _reopened.get(key)
    if store is None:
        # (a store pickled by an earlier vcdask version may still carry its secrets in kwargs)
        store = _reopened.setdefault(key, open_store(location, **{**kwargs, **lookup_credentials(location)}))
    return store
