"""The vcdask exception tree.

Every error raised on purpose by vcdask derives from :class:`VcdaskError`.  Narrow
errors also derive from the builtin a caller would naturally catch, so
``except KeyError`` still works for an unknown version and ``except OSError``
for a storage fault.  Errors are grouped by what a handler would do about them:

* bad input (``ValueError`` / ``TypeError``): fix the call;
* not found (``KeyError`` / ``FileNotFoundError``): ask for something that exists;
* storage faults (``OSError`` family): retry later, fix credentials or endpoint;
* conflicts: re-read and try again.
"""

from __future__ import annotations

__all__ = [
    "BranchExistsError",
    "InvalidLocationError",
    "ParameterMismatchError",
    "ReadOnlyStoreError",
    "StoreAccessDeniedError",
    "StoreConflict",
    "StoreError",
    "StoreExistsError",
    "StoreNotFoundError",
    "StoreUnreachableError",
    "TagExistsError",
    "VcdaskError",
    "VersionNotFoundError",
]


class VcdaskError(Exception):
    """Root of every error vcdask raises on purpose."""


class ParameterMismatchError(VcdaskError, ValueError):
    """Parameters do not match a model or a stored layout (names, shapes or dtypes)."""


class InvalidLocationError(VcdaskError, ValueError):
    """A store location or storage option that vcdask cannot interpret."""


class StoreError(VcdaskError, OSError):
    """A fault while talking to the parameter store."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The store, its bucket or its container does not exist (or is not a vcdask store)."""


class StoreExistsError(StoreError, FileExistsError):
    """``mode="w-"`` was asked for, and a store already exists there."""


class StoreAccessDeniedError(StoreError, PermissionError):
    """The storage service refused the credentials, or the store was opened read-only."""


class ReadOnlyStoreError(StoreAccessDeniedError):
    """A write was attempted on a store opened with ``mode="r"``."""


class StoreUnreachableError(StoreError, ConnectionError):
    """The storage endpoint could not be reached (refused, timed out, DNS failure)."""


class StoreConflict(StoreError):
    """A commit lost a race with another writer and was not applied.

    Nothing was written to the branch; the caller may re-read the head and try again.
    """


class VersionNotFoundError(VcdaskError, KeyError):
    """An unknown version id, tag or branch."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class TagExistsError(VcdaskError, ValueError):
    """A tag of that name already exists; tags are immutable."""


class BranchExistsError(VcdaskError, ValueError):
    """A branch of that name already exists."""
