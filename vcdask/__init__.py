"""vcdask: train PyTorch models on cheap, unreliable, mixed hardware with Dask and VC-ASGD."""

from __future__ import annotations

from . import cloud, lr_schedules, merge
from . import config as _config  # noqa: F401  (loads vcdask.yaml into dask.config)
from .api import fit, resume
from .cluster import preempt
from .errors import RunFailedError, VcdaskError
from .groups import Merging, Stopping, Training
from .handle import RunHandle
from .loading import load
from .params import FlatParams, Layout, flatten, load_into
from .reach import attach
from .resilience import Resilience
from .result import FitResult
from .store import Checkpoint, GCReport, ParamStore, Retention, VersionInfo, open_store

__all__ = [
    "Checkpoint",
    "FitResult",
    "FlatParams",
    "GCReport",
    "Layout",
    "Merging",
    "ParamStore",
    "Resilience",
    "Retention",
    "RunFailedError",
    "RunHandle",
    "Stopping",
    "Training",
    "VcdaskError",
    "VersionInfo",
    "attach",
    "cloud",
    "fit",
    "flatten",
    "load",
    "load_into",
    "lr_schedules",
    "merge",
    "open_store",
    "preempt",
    "resume",
]

__version__ = "0.1.0"
