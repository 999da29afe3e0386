"""The release rule's parts: the releases in a store, and models scored on a run's validation data.

Both the candidate and the last release are scored here, in this process, on the same rows (the run's
validation data as the run read it) with the run's own loss and metric functions
(:func:`vcdask.steps.evaluate`): the comparison does not depend on when, where or on what data the
release was trained.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["last_release", "score"]

#: Validation rows scored per forward pass.
ROWS_PER_BATCH = 4096


def last_release(tags: Mapping[str, str], prefix: str) -> tuple[int, str | None]:
    """``(N, name)`` of the newest tag ``<prefix>N`` in ``tags`` (tag name -> version), or ``(0, None)``.

    Examples
    --------
    >>> last_release({"nightly-1": "A", "nightly-10": "B", "nightly-2": "C", "other": "D"}, "nightly-")
    (10, 'nightly-10')
    >>> last_release({}, "nightly-")
    (0, None)
    """
    numbered = [(int(m.group(1)), t) for t in tags if (m := re.fullmatch(rf"{re.escape(prefix)}(\d+)", t))]
    return max(numbered) if numbered else (0, None)


def score(spec: Any, models: Mapping[str, torch.nn.Module]) -> dict[str, dict[str, float]]:
    """Each model's validation numbers (``loss`` and the run's metrics) on the run's validation data.

    Parameters
    ----------
    spec : vcdask.spec.RunSpec
        The run: its validation data (staged or where it lives), loss, metrics and input dtype.
    models : mapping of str to torch.nn.Module
        The models to score, by name.

    Returns
    -------
    dict
        name -> ``{"loss": ..., <metric>: ...}``.

    Raises
    ------
    ValueError
        The run has no validation data, or trained with a custom ``train_step`` on non-``(X, y)`` data.
    """
    from ..device import Precision
    from ..steps import evaluate

    source = spec.validation
    if source is None:
        raise ValueError(f"run {spec.run_id!r} has no validation data to score models on")
    if getattr(source, "form", "xy") != "xy":
        raise ValueError(f"run {spec.run_id!r} validates with a custom step: a release needs (X, y) validation data")
    precision = Precision("32", torch.device("cpu"))
    ds = source.open()
    return {name: evaluate(spec, model.cpu(), _batches(spec, source, ds), precision) for name, model in models.items()}


def _batches(spec: Any, source: Any, ds: Any) -> Iterator[tuple[tuple[torch.Tensor, torch.Tensor], int]]:
    from ..batches import cast_like_training

    for start in range(0, source.n, ROWS_PER_BATCH):
        X, y = source.read(start, min(start + ROWS_PER_BATCH, source.n), ds)
        x = cast_like_training(torch.as_tensor(X.copy()), spec, "X")
        t = cast_like_training(torch.as_tensor(y.copy()), spec, "y")
        yield (x, t), len(X)
