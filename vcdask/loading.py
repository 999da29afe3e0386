"""Load any stored version back into a model: ``vcdask.load(store, version=...)``."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from .store import ParamStore, open_store

__all__ = ["load"]


def load(
    store: ParamStore | str | os.PathLike,
    model: torch.nn.Module | None = None,
    *,
    version: str | None = None,
    tag: str | None = None,
    branch: str = "main",
    **storage_options: Any,
) -> torch.nn.Module:
    """A model holding one stored version of the server parameters.

    Parameters
    ----------
    store : ParamStore, str or path-like
        An open store, or its location (``"vcdask-runs"``, a ``pathlib.Path``, ``"s3://bucket/runs"``, ...),
        opened read-only with ``storage_options``.
    model : torch.nn.Module, optional
        Load into this module (in place) and return it.  Without one, the run that committed
        the version supplies its model: a copy of the module given to :func:`vcdask.fit`.
    version, tag : str, optional
        Which version: an id, or a tag.  Default: the newest version on ``branch``.
    branch : str, default "main"
        The branch to read the newest version of (a run's branch is its ``run_id``).

    Returns
    -------
    torch.nn.Module
        The model, in eval mode, with the version's parameters.  Its ``vcdask_version``
        attribute holds the version's metadata, its ``id``, the ``tag`` it was loaded by (or None) and
        the ``store``'s location (these three over any metadata keys of the same names);
        :func:`vcdask.fit` records them as the run's start.

    Raises
    ------
    VersionNotFoundError
        No such version, tag or branch.
    ParameterMismatchError
        ``model`` does not have the stored parameters (names, shapes, dtypes listed).
    ValueError
        No ``model`` was given and the version was not committed by a vcdask run.

    Examples
    --------
    >>> model = vcdask.load("vcdask-runs", tag="production")          # doctest: +SKIP
    >>> model = vcdask.load(result.store, MyNet(), version=result.version)  # doctest: +SKIP
    """
    if isinstance(store, (str, os.PathLike)):
        store = open_store(store, mode="r", **storage_options)
    elif storage_options:
        raise TypeError(f"storage options {sorted(storage_options)} apply to a location, not to an open store")
    checkpoint = store.read(version, branch=branch, tag=tag)
    if model is None:
        model = _run_model(store, checkpoint)
    checkpoint.load_into(model)
    model.eval()
    # where it came from: a later fit records it as the run's start (FitResult.start); vcdask's keys last, so
    # that metadata of the same names (a user's {"id": "experiment-7"}) never stands for the version's
    model.vcdask_version = {  # type: ignore[assignment]
        **checkpoint.metadata,
        "id": checkpoint.version,
        "tag": tag,
        "store": store.location,
    }
    return model


def _run_model(store: ParamStore, checkpoint) -> torch.nn.Module:
    from .spec import load_spec

    run_id = checkpoint.metadata.get("run_id")
    if not run_id:
        raise ValueError(
            f"version {checkpoint.version!r} was not committed by a vcdask run (its metadata has no "
            "run_id), so there is no model to load it into: pass model="
        )
    try:
        spec = load_spec(store, run_id)
    except FileNotFoundError:
        raise ValueError(
            f"the spec of run {run_id!r} (which committed version {checkpoint.version!r}) is gone "
            f"from {store.location}: pass model="
        ) from None
    return copy.deepcopy(spec.model)
