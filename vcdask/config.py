"""vcdask's defaults in ``dask.config`` (``vcdask.*``), as distributed and dask-cloudprovider do it."""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

__all__ = ["get"]

_fn = os.path.join(os.path.dirname(__file__), "vcdask.yaml")
with open(_fn) as f:
    _defaults = yaml.safe_load(f)

dask.config.update_defaults(_defaults)


def get(key: str, override: Any = None) -> Any:
    """``dask.config.get("vcdask." + key)``, or ``override`` when it is not None."""
    return override if override is not None else dask.config.get(f"vcdask.{key}")
