"""The run's spec as a worker's task reads it, and what keeps a worker from reading it, raised as that worker's
fault (:func:`run_spec`): the run's core then gives the worker no more shards (``unfit``), instead of failing the
run or spending the shard's attempts on it."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from .errors import StoreNotFoundError, StoreNotSharedError, WorkerEnvironmentError
from .spec import RunSpec, load_spec

__all__ = ["missing_module", "run_spec"]


def run_spec(store: Any, run_id: str, here: Callable[[], str]) -> RunSpec:
    """The run's spec (``here()``: this worker's address, for the messages).

    What keeps this worker from reading it at all is raised as this worker's fault, naming it and the remedy (the
    run gives it no more shards): :class:`~vcdask.errors.StoreNotSharedError` (no store, or one without the run,
    at the store's location here), :class:`~vcdask.errors.WorkerEnvironmentError` (a module of the spec's, the
    model class's, that it cannot import).  A task's own error (its step's, its data's) is raised as is.
    """
    try:
        return load_spec(store, run_id)
    except FileNotFoundError as e:  # (StoreNotFoundError too: no store here)
        where = here()
        if isinstance(e, StoreNotFoundError) and e.location is not None:
            what = f"no vcdask store at {e.location} here"
        else:
            what = f"no run {run_id} in it here ({e})"
        local = "://" not in store.location or store.location.startswith("file:")
        remedy = (
            "a local store must be on a filesystem every worker shares; use an object store for a fleet"
            if local
            else "give every worker the same store location and credentials"
        )
        raise StoreNotSharedError(
            f"worker {where} does not see the store at {store.location} ({what}): {remedy}", process=where
        ) from e
    except (ImportError, AttributeError) as e:  # (unpickling: a module or a name this worker lacks)
        where = here()
        module = missing_module(e)
        mod = f"module {module!r}" if module else "the module of the run's model class (or of its data, its loss)"
        raise WorkerEnvironmentError(
            f"worker {where} cannot load run {run_id}'s model: {type(e).__name__}: {e}; install {mod} on every "
            "worker (the same version as the client's), send it with client.upload_file(...), or define the "
            "class in the script's __main__ (pickled by value)",
            process=where,
        ) from e


def missing_module(e: BaseException) -> str | None:
    """The module to install for what unpickling a spec raised: an :class:`ImportError`'s module (``e.name``), an
    :class:`AttributeError`'s (a name a module here lacks: ``e.obj``'s name when it is a module, ``e.name`` being
    the attribute); None when not known."""
    if isinstance(e, ImportError):
        return e.name
    owner = getattr(e, "obj", None) if isinstance(e, AttributeError) else None
    return owner.__name__ if isinstance(owner, types.ModuleType) else None
