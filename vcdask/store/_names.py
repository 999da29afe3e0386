"""Branches and tags of an Icechunk-backed store: the version a branch names (:meth:`IcechunkParamStore.head`),
making them (:meth:`IcechunkParamStore.tag`, :meth:`IcechunkParamStore.create_branch`), and checking that
what they name is a vcdask version."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..errors import BranchExistsError, VersionNotFoundError
from ._errors import translate
from ._history import is_reserved
from ._layout import is_version
from ._version import version_id

if TYPE_CHECKING:
    import icechunk

    from ._backend import StoreBackend

__all__ = ["NamedStore", "create_branch", "create_tag", "head", "require_version"]


class NamedStore(Protocol):
    """What this module uses of an Icechunk-backed store (:class:`~vcdask.store.IcechunkParamStore`):
    its repository, its backend, and its two helpers that put a snapshot or an Icechunk error about a
    name in vcdask's terms (a commit and a read use them too: :class:`~._commit.CommitStore`,
    :class:`~._read.ReadStore`).

    Attributes
    ----------
    _repo : icechunk.Repository
        The store's repository.
    _backend : StoreBackend
        Its storage backend (for messages).
    """

    _repo: icechunk.Repository
    _backend: StoreBackend

    def _version_or_none(self, snapshot_id: str | None) -> str | None:
        """``snapshot_id`` if it is a vcdask version, else None."""

    def _ref_error(
        self, e: Exception, *, version: str | None = None, tag: str | None = None, branch: str | None = None
    ) -> Exception:
        """Icechunk's error ``e`` about a version, tag or branch as vcdask's."""


def head(store: NamedStore, branch: str) -> str | None:
    """The newest version id on ``branch``, or None when the branch has no versions yet.

    Raises
    ------
    VersionNotFoundError
        The branch does not exist.
    """
    import icechunk

    try:
        return store._version_or_none(store._repo.lookup_branch(branch))
    except icechunk.IcechunkError as e:
        raise store._ref_error(e, branch=branch) from None


def require_version(store: NamedStore, version: str) -> str:
    """``version``, once checked to be a vcdask version of ``store``.

    Raises
    ------
    VersionNotFoundError
        Unknown version, or a snapshot that is not a vcdask version (e.g. the repository's root).
    """
    import icechunk

    version = version_id(version)
    try:
        snap = store._repo.lookup_snapshot(version)
    except icechunk.IcechunkError as e:
        raise store._ref_error(e, version=version) from None
    if not is_version(snap):
        raise VersionNotFoundError(f"{version!r} is not a vcdask version of {store._backend.describe()}")
    return version


def create_tag(store: NamedStore, name: str, version: str) -> None:
    """Tag ``version`` of ``store`` as ``name``; see :meth:`IcechunkParamStore.tag`."""
    import icechunk

    require_version(store, version)
    try:
        store._repo.create_tag(name, version)
    except icechunk.IcechunkError as e:
        raise translate(e, f"tagging version {version!r} as {name!r}") from None


def create_branch(store: NamedStore, name: str, version: str | None) -> None:
    """Create branch ``name`` of ``store`` at ``version`` (None: an empty branch); see
    :meth:`IcechunkParamStore.create_branch`."""
    import icechunk

    if is_reserved(name):
        raise ValueError(f"branch names starting with 'vcdask.keep.' or 'vcdask.hold.' belong to vcdask: {name!r}")
    if name in store._repo.list_branches():
        raise BranchExistsError(f"branch {name!r} already exists in {store._backend.describe()}")
    start = _root_snapshot(store) if version is None else require_version(store, version)
    try:
        store._repo.create_branch(name, start)
    except icechunk.IcechunkError as e:
        raise translate(e, f"creating branch {name!r}") from None


def _root_snapshot(store: NamedStore) -> str:
    """The repository's root snapshot (where an empty branch starts)."""
    *_, root = store._repo.ancestry(branch="main")
    return root.id
