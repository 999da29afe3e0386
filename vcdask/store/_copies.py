"""What a pickled copy of a store carries, and how it reopens where it is unpickled.

A store pickles as a call of ``vcdask.store._icechunk._reopen`` with ``vcdask.store.open_store``, the
location and the options of :func:`split_options`'s public half (never a secret: run specs and task
arguments hold such pickles), opened with the mode of :func:`copy_mode`.  :func:`reopen` unpickles it as a
store not opened yet (:class:`Unopened`): it opens at its first use, so that unpickling reads nothing.
"""

from __future__ import annotations

import threading
from abc import ABC
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._base import ParamStore
from ._secrets import lookup_credentials

if TYPE_CHECKING:
    from ._backend import StoreBackend

__all__ = ["Unopened", "copy_mode", "reopen", "split_options"]

#: The stores unpickled in this process, by (location, options), the most recently used last: a worker's tasks
#: reuse one store (its repository opened once); a long-lived worker that serves runs in many stores keeps the
#: newest ones (a store dropped here stays open for whatever still holds it, and a later copy opens it again).
_reopened: OrderedDict[tuple, Any] = OrderedDict()
_reopened_lock = threading.Lock()
MAX_REOPENED = 16


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
    """Unpickle a store: one store per (location, options) per process (workers reuse it; the
    :data:`MAX_REOPENED` used last are kept), opened at its first use (:class:`Unopened`), not here.

    ``kwargs`` holds no secret; the credentials registered in this process for ``location``
    (if any) are added when it opens, else the backend falls back to the provider's standard chain.
    """
    # (a store pickled by an earlier vcdask version carries its own mode: a copy opens what exists, see copy_mode)
    kwargs = {**kwargs, "mode": copy_mode(kwargs.get("mode", "a"))}
    key = (location, repr(sorted(kwargs.items())))
    with _reopened_lock:
        store = _reopened.get(key)
        if store is None:
            store = _reopened[key] = Unopened(open_store, location, kwargs)
            while len(_reopened) > MAX_REOPENED:
                _reopened.popitem(last=False)
        else:
            _reopened.move_to_end(key)
    return store


class Unopened(ABC):  # (ParamStore's base: taking a store's class in place needs the same layout)
    """An unpickled store that opens at its first use: then it *becomes* the store ``open_store`` opens
    (an :class:`~vcdask.store.IcechunkParamStore`: its class and attributes), in place.

    Unpickling reads nothing: a run spec unpickled from a store that was copied or moved names the store it
    was written in without opening it (:func:`vcdask.spec.loads` binds it to where it was read), and a Dask
    worker that cannot open a task's store fails the task with the store's error (e.g.
    :class:`~vcdask.errors.StoreAccessDeniedError`) instead of failing to deserialize the task's message
    (which cost the worker its connection to the scheduler).

    Its location and mode are known before it opens; every other attribute opens it (a failed open
    raises its error there, and the next use tries again).  The store that opens must hold nothing that
    refers to itself by identity: its attributes move over to this object.
    """

    location: str
    mode: str

    def __init__(self, open_store: Callable[..., Any], location: str, kwargs: dict[str, Any]):
        self.location = location
        self.mode = kwargs["mode"]
        self._unopened = (open_store, location, kwargs)
        self._opening = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        # (only for what this object lacks: any attribute of the store but its location and mode)
        if name.startswith("__") or name in ("_unopened", "_opening"):
            raise AttributeError(name)
        self._open()
        return getattr(self, name)

    def _open(self) -> None:
        with self._opening:
            if type(self) is not Unopened:  # (another thread opened it meanwhile)
                return
            open_store, location, kwargs = self._unopened
            # (a store pickled by an earlier vcdask version may still carry its secrets in kwargs)
            store = open_store(location, **{**kwargs, **lookup_credentials(location)})
            self.__dict__.update(store.__dict__)
            self.__class__ = type(store)  # (from here on it is that store, its methods found as ever)

    def __reduce__(self):
        # As the store pickles once opened (a call of the ``_reopen`` beside ``open_store``, by the name every
        # pickle of a store has: earlier vcdask versions read it); that module imports this one.
        open_store = self._unopened[0]
        return (open_store.__globals__["_reopen"], self._unopened)

    def __repr__(self) -> str:
        return f"<store {self.location!r} mode={self.mode!r}, not opened yet in this process>"


ParamStore.register(Unopened)
