"""The versioned parameter store.

:func:`open_store` turns a location into a :class:`ParamStore`; each backend lives
in its own private module (a :class:`StoreBackend`, found by the location's scheme in
:data:`BACKENDS`) and stores versions in an Icechunk repository.

Credentials never travel with a store: a pickled store carries its location and non-secret
options only.  Workers and the scheduler use their own credentials (environment, profile,
instance role) or those given to them with :func:`share_credentials`; :func:`check_cluster_access`
checks before a run that they can read the store.
"""

from __future__ import annotations

from ._backend import StoreBackend
from ._base import Checkpoint, ParamStore, VersionInfo
from ._credentials import (
    FSSPEC_SECRET_OPTIONS,
    StoreCredentials,
    check_cluster_access,
    share_credentials,
    store_holds_secrets,
)
from ._icechunk import IcechunkParamStore, open_store
from ._retention import GCReport, Retention
from ._schemes import BACKENDS
from ._schemes import MODES as MODES  # (importable from here as it was; not in __all__)

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
