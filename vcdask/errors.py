"""The vcdask exception tree.

Every error raised on purpose by vcdask derives from :class:`VcdaskError`.  Narrow
errors also derive from the builtin a caller would naturally catch, so
``except KeyError`` still works for an unknown version and ``except OSError``
for a storage fault.  Errors are grouped by what a handler would do about them:

* bad input (``ValueError`` / ``TypeError``): fix the call;
* not found (``KeyError`` / ``FileNotFoundError``): ask for something that exists;
* storage faults (``OSError`` family): retry later, fix credentials or endpoint;
* conflicts: re-read and try again;
* a run that failed or cannot go on (``RuntimeError``): look at the run's error and history.
"""

from __future__ import annotations

__all__ = [
    "BranchExistsError",
    "DataError",
    "InvalidLocationError",
    "NoWorkersError",
    "ParameterMismatchError",
    "ReadOnlyStoreError",
    "RunFailedError",
    "RunNotFoundError",
    "StoreAccessDeniedError",
    "StoreConflict",
    "StoreCredentialsError",
    "StoreError",
    "StoreExistsError",
    "StoreNotFoundError",
    "StoreOutageError",
    "StoreUnreachableError",
    "TagExistsError",
    "UnknownMergeRuleError",
    "UnknownPolicyError",
    "UnknownScheduleError",
    "VcdaskError",
    "VersionNotFoundError",
]


class VcdaskError(Exception):
    """Root of every error vcdask raises on purpose."""


class ParameterMismatchError(VcdaskError, ValueError):
    """Parameters do not match a model or a stored layout (names, shapes or dtypes)."""


class DataError(VcdaskError, ValueError):
    """Training data that cannot be used: empty, mismatched lengths, unknown variables ..."""


class UnknownMergeRuleError(VcdaskError, ValueError):
    """A merge rule name that is not registered (the message lists those that are)."""


class UnknownScheduleError(VcdaskError, ValueError):
    """An alpha schedule name that does not exist."""


class UnknownPolicyError(VcdaskError, ValueError):
    """An ``on_shard_failure`` policy that does not exist."""


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


class StoreCredentialsError(StoreAccessDeniedError):
    """Some process of the cluster has no credentials for the store (or they are refused).

    A store never carries its secrets to other processes; the message names the processes
    that cannot read the store and how to give them credentials.
    """


class ReadOnlyStoreError(StoreAccessDeniedError):
    """A write was attempted on a store opened with ``mode="r"``."""


class StoreUnreachableError(StoreError, ConnectionError):
    """The storage endpoint could not be reached (refused, timed out, DNS failure)."""


class StoreOutageError(StoreError, RuntimeError):
    """The store stayed unavailable for longer than ``store_outage_timeout``; the run gave up.

    The store is readable at its last commit.
    """


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


class RunNotFoundError(VcdaskError, KeyError):
    """No run with that id on this scheduler."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RunFailedError(VcdaskError, RuntimeError):
    """A run stopped with an error on the cluster (the message carries the scheduler-side traceback)."""


class NoWorkersError(VcdaskError, RuntimeError):
    """The run had no usable worker for longer than ``no_worker_timeout``."""
