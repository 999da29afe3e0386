"""vcdask: train PyTorch models on cheap, unreliable, mixed hardware with Dask and VC-ASGD."""

from __future__ import annotations

from . import config as _config  # noqa: F401  (loads vcdask.yaml into dask.config)
from .api import FitResult, RunFailedError, fit
from .errors import VcdaskError
from .params import FlatParams, Layout, flatten, load_into
from .store import Checkpoint, ParamStore, VersionInfo, open_store

__all__ = [
    "Checkpoint",
    "FitResult",
    "FlatParams",
    "Layout",
    "ParamStore",
    "RunFailedError",
    "VcdaskError",
    "VersionInfo",
    "fit",
    "flatten",
    "load_into",
    "open_store",
]

__version__ = "0.1.0"
