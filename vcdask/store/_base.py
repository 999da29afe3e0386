"""The parameter-store interface shared by every backend (its values, :class:`VersionInfo` and
:class:`Checkpoint`, are in :mod:`._version`)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from ._version import Checkpoint, VersionInfo

if TYPE_CHECKING:
    import torch

    from ..params import FlatParams
    from ._files import SideFiles
    from ._retention import GCReport, Retention

__all__ = ["Checkpoint", "ParamStore", "VersionInfo"]


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate commit metadata: a JSON-serialisable mapping with string keys."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping, got {type(metadata).__name__}")
    out = dict(metadata)
    for key in out:
        if not isinstance(key, str):
            raise TypeError(f"metadata keys must be strings, got {key!r}")
        if key.startswith("vcdask:"):
            raise ValueError(f"metadata key {key!r} is reserved (keys starting with 'vcdask:' belong to vcdask)")
    try:
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable (finite numbers, str, list, dict): {e}") from None
    return out


class ParamStore(ABC):
    """A versioned store of model parameters.

    Every :meth:`commit` creates a new immutable version on a branch; any version
    can be read back, tagged, or used as the start of a new branch.

    Capability flags tell callers (the training engine, tests) what a backend can do.
    """

    #: Whether other processes (Dask workers) can open the same store from ``location``.
    shared_across_processes: bool = True
    #: Whether the data survives the process that wrote it.
    durable: bool = True

    location: str
    mode: str

    @property
    def writable(self) -> bool:
        """False for stores opened with ``mode="r"``."""
        return self.mode != "r"

    def describe(self) -> str:
        """The store's location in words, for messages (never a secret)."""
        return repr(self.location)

    @property
    def holds_secrets(self) -> bool:
        """Whether the store was opened in this process with explicit secret options.

        A pickled copy never carries them: in another process it uses that process's
        credentials (see :func:`vcdask.store.check_cluster_access`).
        """
        return False

    @property
    @abstractmethod
    def files(self) -> SideFiles:
        """Plain objects beside the versions, under ``<store>/runs/``: run specifications, client updates, staged data.

        Whole-object ``put`` / ``get`` / ``exists`` / ``delete`` / ``list`` by path relative to
        ``<store>/runs``, and :meth:`SideFiles.zarr_store` for a Zarr group there (staged training
        data).  Versions never live here, and the store never reads or deletes these objects itself.
        """

    @abstractmethod
    def commit(
        self,
        params: FlatParams | torch.nn.Module | Mapping[str, Any],
        metadata: Mapping[str, Any] | None = None,
        *,
        branch: str = "main",
        message: str | None = None,
        parent: str | None = None,
        state: Mapping[str, FlatParams] | None = None,
        keep_from: int | None = None,
    ) -> str:
        """Commit ``params`` (and a merge rule's ``state``) as a new version on ``branch``; return its id."""

    @abstractmethod
    def read_state(self, version: str) -> dict[str, FlatParams]:
        """The merge rule's state committed with ``version`` (empty when there is none; only a
        branch's newest version keeps it)."""

    @abstractmethod
    def read(self, version: str | None = None, *, branch: str = "main", tag: str | None = None) -> Checkpoint:
        """Read one version (default: the newest on ``branch``)."""

    @abstractmethod
    def versions(self, branch: str | None = None) -> list[VersionInfo]:
        """The branch's history, newest first (None: ``"main"``)."""

    @abstractmethod
    def head(self, branch: str = "main") -> str | None:
        """The newest version id on ``branch`` (None when it has no versions yet)."""

    @abstractmethod
    def tag(self, name: str, version: str) -> None:
        """Give ``version`` an immutable name."""

    @abstractmethod
    def tags(self) -> dict[str, str]:
        """Tag name -> version id."""

    @abstractmethod
    def create_branch(self, name: str, version: str | None = None) -> None:
        """Create branch ``name`` starting at ``version`` (None: an empty branch)."""

    @abstractmethod
    def branches(self) -> dict[str, str | None]:
        """Branch name -> newest version id (None for an empty branch)."""

    # -- retention ------------------------------------------------------------------------
    def gc(
        self,
        retention: Retention | None = None,
        *,
        branches: str | Iterable[str] | None = None,
        dry_run: bool = False,
        in_use: Mapping[str, int | None] | None = None,
    ) -> GCReport:
        """Expire the versions ``retention`` does not keep, and delete their data.

        Kept: the newest ``keep_last`` versions of each branch, tagged versions, the last version of
        each epoch, every ``every``-th, and every version in use (by a running run's tasks, or held
        by a reader with :meth:`hold`).  The rest is expired with Icechunk's snapshot expiry and its
        chunks, manifests and snapshots deleted with Icechunk's garbage collection.  Old versions a
        policy keeps stay readable by id and are listed by :meth:`versions`.  ``vcdask.fit`` does
        this for its own branch during the run (see its ``retention`` option); call it for the runs
        of a store written before, or with another policy (``vcdask gc STORE`` from a shell).

        Parameters
        ----------
        retention : Retention, optional
            Default: ``Retention()`` (the newest 5, tagged versions, each epoch's last version).
        branches : str or iterable of str, optional
            The branches to apply the policy to (default: every branch).  The others keep what
            they need: a running run the versions it still uses, a branch without a policy all
            of its history (which then holds back expiry in the whole store: see
            ``GCReport.held_back``).
        dry_run : bool, default False
            Only report what would be removed.
        in_use : mapping of str to int, optional
            Branch -> the oldest step the tasks of the run writing it still read (``vcdask.fit``
            passes it).  Without it, a branch written recently (``vcdask.store.idle-after``, an hour)
            keeps what its writer marked in use with its newest version.

        Returns
        -------
        GCReport
            What was kept and removed, per branch, and the bytes deleted.

        Raises
        ------
        VersionNotFoundError
            An unknown branch.
        ReadOnlyStoreError
            The store was opened with ``mode="r"`` (and ``dry_run`` is False).
        TypeError
            ``retention`` is not a :class:`vcdask.Retention`.

        Examples
        --------
        >>> store = vcdask.open_store("vcdask-runs")                    # doctest: +SKIP
        >>> store.gc(vcdask.Retention(keep_last=2), dry_run=True).n_removed   # doctest: +SKIP
        118
        """
        raise NotImplementedError(f"{type(self).__name__} does not support retention")

    def hold(self, version: str, *, ttl: float = 3600.0) -> AbstractContextManager[str]:
        """Keep ``version`` readable while a ``with`` block runs, whatever collections run meanwhile.

        A collection in any process (:meth:`gc`, a run's retention) keeps a held version.  Take the
        hold before reading a version the policy does not keep.

        Parameters
        ----------
        version : str
        ttl : float, default 3600
            Seconds after which the hold of a process that died without releasing it stops counting
            (finite, > 0).

        Returns
        -------
        context manager
            Yields ``version``; releases the hold on exit.

        Raises
        ------
        ValueError
            ``ttl`` is not finite or not above zero (a ``TypeError`` when it is not a number).
        VersionNotFoundError
            The version is gone, or a collection is removing it.
        ReadOnlyStoreError
            The store was opened with ``mode="r"`` (a hold is written to the store).

        Examples
        --------
        >>> with store.hold(version):                                   # doctest: +SKIP
        ...     model = vcdask.load(store, version=version)
        """
        raise NotImplementedError(f"{type(self).__name__} does not support holds")

    def version_nbytes(self, version: str) -> int:
        """Bytes of one version's parameter arrays as stored (its rule state not included).

        Raises
        ------
        VersionNotFoundError
            Unknown version.
        """
        raise NotImplementedError(f"{type(self).__name__} does not report sizes")

    def store_nbytes(self) -> int:
        """Bytes of every object of the store: versions, the repository's metadata, side files."""
        raise NotImplementedError(f"{type(self).__name__} does not report sizes")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.location!r} mode={self.mode!r}>"
