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

import concurrent.futures

__all__ = [
    "BranchExistsError",
    "ClusterPackageError",
    "DataError",
    "DeviceUnavailableError",
    "InvalidLocationError",
    "MainGuardError",
    "MissingRegionError",
    "NoWorkersError",
    "ParameterMismatchError",
    "ReadOnlyStoreError",
    "RunCancelledError",
    "RunFailedError",
    "RunLiveElsewhereError",
    "RunNotFoundError",
    "SchedulerEnvironmentError",
    "StoreAccessDeniedError",
    "StoreConflict",
    "StoreCredentialsError",
    "StoreError",
    "StoreExistsError",
    "StoreIntegrityError",
    "StoreNotFoundError",
    "StoreNotSharedError",
    "StoreOutageError",
    "StoreUnreachableError",
    "TagExistsError",
    "UnknownMergeRuleError",
    "UnknownPolicyError",
    "UnknownScheduleError",
    "VcdaskError",
    "VersionNotFoundError",
    "WorkerEnvironmentError",
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


class MissingRegionError(InvalidLocationError):
    """No region is set for an S3 bucket (not in the storage options, the environment or a profile).

    The message gives the remedy in Python terms (``region=``); the command line and job files build
    their own from the attributes.

    Attributes
    ----------
    what : str or None
        What was being done, e.g. ``"opening 's3://bucket/runs'"``.
    cause : str or None
        The storage SDK's own words.
    """

    def __init__(self, message: str, *, what: str | None = None, cause: str | None = None):
        super().__init__(message)
        self.what, self.cause = what, cause


class StoreError(VcdaskError, OSError):
    """A fault while talking to the parameter store.

    Attributes
    ----------
    unsent : bool
        True when a commit failed before it was sent to the store: no version can have landed.
        (False otherwise: a failed commit may still have landed, its answer lost.)
    """

    unsent: bool = False


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The store, its bucket or its container does not exist (or is not a vcdask store).

    Attributes
    ----------
    location : str or None
        Where no store was found, in words (``"local directory '/data/runs'"``), when the store itself is
        missing; None when something else is (a bucket, a container).
    mode : str or None
        The mode the store was opened with (``"r"``, ``"r+"``), when it refused to create the store.
    missing : str or None
        What is missing: ``"store"`` (with ``location`` and ``mode``), ``"bucket"`` (the bucket or
        container), or None when vcdask cannot tell.
    """

    def __init__(self, *args, location: str | None = None, mode: str | None = None, missing: str | None = None):
        super().__init__(*args)
        self.location, self.mode = location, mode
        self.missing = "store" if missing is None and location is not None else missing


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


class StoreIntegrityError(StoreError):
    """A version's stored bytes are not those it was committed with (its recorded checksums differ):
    a chunk was changed or damaged after the commit.  Older versions may still load."""


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


class RunLiveElsewhereError(VcdaskError, RuntimeError):
    """A resume on one scheduler of a run that still goes on at another (the one its record names): two drivers
    on one branch would overwrite each other's uploads and commits.  The message names that scheduler and how to
    follow the run there (:func:`vcdask.attach`)."""


class RunFailedError(VcdaskError, RuntimeError):
    """A run stopped with an error on the cluster (the message carries the scheduler-side traceback)."""


class RunCancelledError(VcdaskError, concurrent.futures.CancelledError):
    """The run was cancelled (:meth:`vcdask.RunHandle.cancel`): it has no result; its store stays
    readable at the last version it committed."""


class MainGuardError(VcdaskError, RuntimeError):
    """Worker processes would be started from a script's top level without ``if __name__ == "__main__":``."""


class ClusterPackageError(VcdaskError, ImportError):
    """The cluster's scheduler or workers cannot import vcdask or PyTorch (refused before the run is staged)."""


class DeviceUnavailableError(VcdaskError, RuntimeError):
    """A process asked to train on a device it does not have (``device="cuda"`` on a worker without a GPU, or
    without that GPU index; ``"mps"`` off Apple silicon).  A run gives such a worker no more shards."""


class NoWorkersError(VcdaskError, RuntimeError):
    """The run had no usable worker for longer than ``no_worker_timeout``."""


class _NamesProcess:
    """An error about one process of the cluster (``process``: its address), which pickles with it (an error
    raised in a Dask task travels to the scheduler and the client by pickle, which keeps ``args`` only)."""

    process: str | None

    def __init__(self, message: str, process: str | None = None):
        super().__init__(message)  # type: ignore[call-arg]  # (the builtin error after it in the MRO)
        self.process = process

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (str(self.args[0]) if self.args else "", self.process))


class WorkerEnvironmentError(_NamesProcess, VcdaskError, ImportError):
    """A worker cannot import what the run's spec needs (the module of the user's model class, of its dataset or
    loss): it could not read the run at all.  A run gives such a worker no more shards and goes on with the others;
    the message names the worker and the remedies.

    Attributes
    ----------
    process : str or None
        The worker's address.
    """


class SchedulerEnvironmentError(_NamesProcess, VcdaskError, ImportError):
    """The scheduler cannot import what the run's spec needs (the module of the user's model class): the run
    cannot start.  The message names the scheduler and the remedies.

    Attributes
    ----------
    process : str or None
        The scheduler's address.
    """


class StoreNotSharedError(_NamesProcess, VcdaskError, FileNotFoundError):
    """A worker does not see the run's store (no store at its location there, or one without the run: another
    machine's directory at the same path).  A run gives such a worker no more shards and goes on with the others.

    Attributes
    ----------
    process : str or None
        The worker's address.
    """
