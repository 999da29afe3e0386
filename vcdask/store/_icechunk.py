"""The Icechunk-backed parameter store (every backend: local, memory, S3, GCS, Azure), and
:func:`open_store`, which makes one (it lives beside the class: a store pickles as a call of it).

One version is one Icechunk snapshot holding the model's flat parameters in one or two
Zarr arrays (see :mod:`._layout`).  Opening or creating the repository is in
:mod:`._repository`; where the credentials come from is in :mod:`._credentials`.  The class's
methods are thin: committing is in :mod:`._commit`, reading in :mod:`._read`, branches and
tags in :mod:`._names`, history and sizes in :mod:`._history`, retention in :mod:`._collect`.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from ..errors import ReadOnlyStoreError
from ..params import FlatParams, flatten
from ._base import Checkpoint, ParamStore, VersionInfo
from ._collect import gc, hold
from ._commit import LastCommit, commit_version
from ._copies import copy_mode, reopen, split_options
from ._credentials import register_credentials
from ._errors import quiet_logs, ref_error
from ._files import SideFiles
from ._flatread import Seen
from ._history import history, is_reserved, point_to_runs, store_nbytes, version_nbytes
from ._layout import is_version
from ._names import create_branch, create_tag, head
from ._read import read_version
from ._repository import open_repository
from ._retention import GCReport
from ._schemes import backend_for
from ._settings import check_ttl, resolve_settings
from ._state import StateWriter, read_state

if TYPE_CHECKING:
    from ._backend import StoreBackend

logger = logging.getLogger(__name__)


class IcechunkParamStore(ParamStore):
    """A :class:`ParamStore` in an Icechunk repository.  Create it with :func:`vcdask.open_store`.

    Thread-safe: several threads may commit and read at once.  Picklable: a copy sent to
    another process (a Dask worker) reopens the same store with the same options, except
    the secret ones (``backend.secret_options``): those stay in this process.  A copy opens an
    existing store (``mode="r+"``, or ``"r"`` for a read-only original), never creates one.  There the copy
    uses the credentials registered in that process (see :func:`vcdask.store.share_credentials`),
    or else the provider's standard chain (environment, profile, instance role).
    """

    def __init__(
        self,
        backend: StoreBackend,
        mode: str,
        *,
        chunk_bytes: int | None = None,
        commit_retries: int | None = None,
        max_tries: int | None = None,
    ):
        self._backend = backend
        self.location = backend.location
        self.mode = mode
        self.shared_across_processes = backend.shared_across_processes
        self.durable = backend.durable
        # (checked before anything is opened)
        self.chunk_bytes, self.commit_retries, self.max_tries = resolve_settings(chunk_bytes, commit_retries, max_tries)
        self._files: SideFiles | None = None
        self._files_lock = threading.Lock()
        public, secrets = split_options(backend)
        # What a pickled copy reopens with: never a secret (it would land in run specs and task arguments),
        # and a mode that opens the store this one opened, never a new one.
        self._open_args = dict(
            mode=copy_mode(mode), chunk_bytes=chunk_bytes, commit_retries=commit_retries, max_tries=max_tries, **public
        )
        self._holds_secrets = bool(secrets)
        quiet_logs()  # the SDKs' Rust warnings stay out of the terminal; failures become errors naming the cause
        self._repo = open_repository(backend, mode, self.max_tries)
        self._pinned: dict[str, VersionInfo] = {}  # versions kept by a pin (immutable): read once
        self._histories: dict[str, Any] = {}  # branch -> what a collection read of it (_needs.bound)
        #: branch -> what this object committed there last (the fast path of ._commit)
        self._last_commit: dict[str, LastCommit] = {}
        self._state_writer = StateWriter()  # rewrites only the rule state arrays that changed
        self._seen: dict[str, Seen] = {}  # what the last read found (the next one asks for it all at once)
        if secrets:  # copies unpickled in this process (an in-process scheduler or worker) use them too
            register_credentials(self.location, **secrets)

    @property
    def holds_secrets(self) -> bool:
        """Whether this store was opened with explicit secret options (which its pickled copies lack)."""
        return self._holds_secrets

    def describe(self) -> str:
        """The store's location in words, for messages (never a secret)."""
        return self._backend.describe()

    # -- side files: run specs, client updates (plain objects beside the repository) ----
    @property
    def files(self) -> SideFiles:
        """Plain objects under ``<store>/runs/`` (outside Icechunk's own prefixes)."""
        with self._files_lock:
            if self._files is None:
                fs, root = self._backend.filesystem(max_tries=self.max_tries)
                self._files = SideFiles(
                    fs,
                    f"{root}/runs",
                    self._backend.describe(),
                    writable=self.writable,
                    store=self,
                    async_fs=self._async_fs,
                )
        return self._files

    def _async_fs(self):
        return self._backend.filesystem(max_tries=self.max_tries, asynchronous=True)[0]

    # -- pickling: reopen the same location elsewhere, without the secrets --------------
    def __reduce__(self):
        return (_reopen, (open_store, self.location, self._open_args))

    # -- writing ----------------------------------------------------------------------
    def commit(
        self, params, metadata=None, *, branch="main", message=None, parent=None, state=None, keep_from=None
    ) -> str:
        """Commit ``params`` as a new, immutable version on ``branch``.

        Parameters
        ----------
        params : FlatParams, torch.nn.Module or mapping of str to tensor/array
            The state to store; modules and state dicts are packed with :func:`vcdask.params.flatten`.
        metadata : mapping, optional
            JSON-serialisable values stored with the version (keys must not start with ``"vcdask:"``).
        branch : str, default "main"
            The branch to commit on; it must exist (see :meth:`create_branch`).
        message : str, optional
            Commit message (default ``"vcdask version"``).
        parent : str, optional
            Compare-and-swap: commit only if the branch's newest version is still ``parent``;
            otherwise raise :class:`StoreConflict` and write nothing.  Without it a commit
            that races another writer is retried on top of the new head (up to
            ``commit_retries`` times), so both commits land.
        state : mapping of str to FlatParams, optional
            A merge rule's state (e.g. momentum buffers), so that a resumed run continues exactly;
            see :meth:`read_state`.  Only the newest version of a branch keeps it: it is written
            beside the version (``<store>/runs/<branch>/rule-state/``) and the state of the version
            this one replaces is deleted once this one has landed.
        keep_from : int, optional
            The writer's retention marker: versions of this branch at or after this step may still
            be needed by it (its newest versions, versions its tasks read), so a collection by
            another process keeps them (see :class:`vcdask.Retention`).

        Returns
        -------
        str
            The new version id.

        Raises
        ------
        StoreConflict
            ``parent`` is no longer the head, or the retries ran out.
        VersionNotFoundError
            The branch does not exist.
        ReadOnlyStoreError
            The store was opened with ``mode="r"``.
        """
        self._check_writable("commit to")
        return commit_version(self, flatten(params), metadata, branch, message, parent, state, keep_from)

    # -- reading ----------------------------------------------------------------------
    def read(self, version=None, *, branch="main", tag=None) -> Checkpoint:
        """Read a version's parameters and metadata.

        Parameters
        ----------
        version : str, optional
            A version id.  Default: the newest version on ``branch`` (or the tagged one).
        branch : str, default "main"
            Branch whose newest version to read when neither ``version`` nor ``tag`` is given.
        tag : str, optional
            Read the version with this tag.

        Returns
        -------
        Checkpoint

        Raises
        ------
        VersionNotFoundError
            Unknown version, tag or branch, or a branch with no versions yet.
        """
        return read_version(self, version, branch, tag)

    def read_state(self, version: str) -> dict[str, FlatParams]:
        """The merge rule's state committed with ``version`` (empty when the rule keeps none).

        Only the newest version of a branch keeps its state (resuming needs nothing else); versions
        written by earlier vcdask releases kept it inside the version, and still have it.

        Raises
        ------
        VersionNotFoundError
            Unknown version, or one whose state is no longer kept (a newer version replaced it).
        """
        import icechunk

        try:
            return read_state(self, version)
        except icechunk.IcechunkError as e:
            raise self._ref_error(e, version=version) from None

    def versions(self, branch: str | None = None) -> list[VersionInfo]:
        """The versions of ``branch``, newest first: its history (a branch made from another includes
        that history), and the older versions a retention policy keeps for it (see :meth:`gc`).

        Read afresh from the store each time: another process may have expired history since.  Every
        run writes its own branch (its run id): asked for no branch (``"main"``), an empty main beside
        run branches warns, naming the newest (``vcdask versions STORE`` lists that one by default).

        Raises
        ------
        VersionNotFoundError
            The branch does not exist.
        """
        import icechunk

        named, branch = branch is not None, branch or "main"
        try:
            listed = history(self, branch)
        except icechunk.IcechunkError as e:
            raise self._ref_error(e, branch=branch) from None
        if not listed and not named:
            point_to_runs(self)
        return listed

    def head(self, branch="main") -> str | None:
        """The newest version id on ``branch``, or None when the branch has no versions yet."""
        return head(self, branch)

    # -- names ------------------------------------------------------------------------
    def tag(self, name: str, version: str) -> None:
        """Tag ``version`` as ``name`` (tags are immutable).

        Raises
        ------
        ValueError
            ``name`` breaks the naming rule (1 to 200 of: ASCII letters, digits, space, ``._+:=@,-``).
        TagExistsError
            A tag called ``name`` exists.
        VersionNotFoundError
            ``version`` is not a version of this store.
        """
        self._check_writable("tag")
        create_tag(self, name, version)

    def tags(self) -> dict[str, str]:
        """Tag name -> version id."""
        return {t: self._repo.lookup_tag(t) for t in sorted(self._repo.list_tags())}

    def create_branch(self, name: str, version: str | None = None) -> None:
        """Create branch ``name`` at ``version``; with no version the branch starts empty.

        Raises
        ------
        ValueError
            ``name`` breaks the naming rule (see :meth:`tag`), or starts with ``vcdask.`` + ``keep.``/``hold.``.
        BranchExistsError
            The branch exists already.
        VersionNotFoundError
            ``version`` is not a version of this store.
        """
        self._check_writable("create a branch in")
        create_branch(self, name, version)

    def branches(self) -> dict[str, str | None]:
        """Branch name -> newest version id (None for a branch with no versions)."""
        return {b: self.head(b) for b in sorted(self._repo.list_branches()) if not is_reserved(b)}

    # -- retention (see ParamStore.gc and ParamStore.hold for the documentation) -------------
    def gc(self, retention=None, *, branches=None, dry_run=False, in_use=None) -> GCReport:
        """Expire the versions ``retention`` does not keep and delete their data; see :meth:`ParamStore.gc`."""
        if not dry_run:
            self._check_writable("collect versions in")
        return gc(self, retention, branches=branches, dry_run=dry_run, in_use=in_use)

    def hold(self, version: str, *, ttl: float = 3600.0) -> AbstractContextManager[str]:
        """Keep ``version`` readable while a ``with`` block runs; see :meth:`ParamStore.hold`."""
        self._check_writable("hold a version of")
        return hold(self, version, check_ttl(ttl))

    def version_nbytes(self, version: str) -> int:
        """Bytes of one version's parameter arrays as stored; see :meth:`ParamStore.version_nbytes`."""
        import icechunk

        try:
            return version_nbytes(self, version)
        except icechunk.IcechunkError as e:
            raise self._ref_error(e, version=version) from None

    def store_nbytes(self) -> int:
        """Bytes of every object of the store; see :meth:`ParamStore.store_nbytes`."""
        return store_nbytes(self)

    # -- helpers ----------------------------------------------------------------------
    def _check_writable(self, action: str) -> None:
        if not self.writable:
            raise ReadOnlyStoreError(f"cannot {action} {self.location!r}: it was opened with mode='r'")

    def _version_or_none(self, snapshot_id: str | None) -> str | None:
        if snapshot_id is None:
            return None
        return snapshot_id if is_version(self._repo.lookup_snapshot(snapshot_id)) else None

    def _ref_error(self, e: Exception, *, version=None, tag=None, branch=None) -> Exception:
        return ref_error(self._repo, self._backend.describe(), e, version=version, tag=tag, branch=branch)


def open_store(
    location: str | os.PathLike | ParamStore,
    *,
    mode: str = "a",
    chunk_bytes: int | None = None,
    commit_retries: int | None = None,
    max_tries: int | None = None,
    **storage_options: Any,
) -> ParamStore:
    """Open (or create) a versioned parameter store.

    Parameters
    ----------
    location : str, path-like or ParamStore
        A local directory (``"runs/store"`` or ``"file:///..."``), ``"memory://name"``
        (this process only), ``"s3://bucket/prefix"``, ``"gs://bucket/prefix"`` or
        ``"az://container/prefix"``.  A ParamStore is returned unchanged.
    mode : {"a", "r", "r+", "w-"}, default "a"
        ``"a"`` opens or creates; ``"r"`` opens an existing store read-only; ``"r+"``
        opens an existing store for writing; ``"w-"`` creates and fails if one exists.
    chunk_bytes : int or str, optional
        Chunk size of the stored flat arrays, >= 1 byte; a string is a size in Dask's spelling (``"4MiB"``)
        (default ``vcdask.store.chunk-bytes``).
    commit_retries : int, optional
        Retries of a commit that lost a race with another writer, >= 0 (default ``vcdask.store.commit-retries``).
    max_tries : int, optional
        Attempts per storage request on transient faults, >= 1 (default ``vcdask.store.max-tries``).  On S3,
        finding and opening the store still take Icechunk 1.1's own 10 tries (the stores guide).
    **storage_options
        Backend options.  S3: ``endpoint_url``, ``region``, ``allow_http``, ``force_path_style``,
        ``access_key_id``/``key``, ``secret_access_key``/``secret``, ``session_token``/``token``,
        ``anonymous``, ``client_kwargs`` (s3fs spelling).  Without credentials the standard
        AWS chain is used (environment, config files, instance metadata).
        GCS: ``service_account_file``, ``service_account_key``, ``application_credentials``,
        ``bearer_token``, ``anonymous``, ``config``.  Azure: ``account`` (required), ``access_key``,
        ``sas_token``, ``bearer_token``, ``config`` (object_store keys; its secret entries, as
        ``config.<key>``, are secret options: see the stores guide).
        Secret options (S3 ``access_key_id``, ``secret_access_key``, ``session_token``; GCS
        ``service_account_key``, ``bearer_token``; Azure ``access_key``, ``sas_token``,
        ``bearer_token``) are used in this process only: a pickled copy of the store (a task
        argument, a run's spec) leaves them out and uses the credentials of the process that
        unpickles it; see :func:`share_credentials` and :func:`check_cluster_access`.

    Returns
    -------
    ParamStore

    Raises
    ------
    InvalidLocationError
        Unknown scheme or storage option (the message lists the valid ones), a bad mode, or a setting
        out of range (``chunk_bytes``, ``commit_retries``, ``max_tries``, as arguments or config values).
    TypeError
        A setting that is not an integer (or, for ``chunk_bytes``, a size).
    StoreNotFoundError
        No store there (``mode="r"``/``"r+"``), a missing bucket, or a directory that holds something else.
    StoreAccessDeniedError
        Credentials refused.
    StoreUnreachableError
        The endpoint cannot be reached.

    Examples
    --------
    >>> store = open_store("memory://doctest")
    >>> import torch
    >>> v = store.commit(torch.nn.Linear(2, 1), {"epoch": 0})
    >>> store.read(v).metadata
    {'epoch': 0}
    """
    if isinstance(location, ParamStore):
        return location
    backend = backend_for(location, mode, storage_options)
    return IcechunkParamStore(
        backend, mode, chunk_bytes=chunk_bytes, commit_retries=commit_retries, max_tries=max_tries
    )


# A store pickles as a call of ``_reopen(open_store, ...)`` (``__reduce__``), and the run specs written to
# stores hold such pickles: they name it by its public path, as ever, whichever module defines it.
open_store.__module__ = "vcdask.store"


def _reopen(open_store, location, kwargs):
    """Unpickle a store (see :func:`._copies.reopen`); its name is in the pickles of run specs: keep it."""
    return reopen(open_store, location, kwargs)
