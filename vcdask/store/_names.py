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

__all__ = ["NamedStore", "check_name", "create_branch", "create_tag", "head", "require_version"]


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


def check_name(name: object, what: str) -> str:
    """``name``, once checked to be a valid name for a branch or tag (``what``).

    A name is a non-empty string without ``/`` (Icechunk keeps each ref under a key named after it)
    and without control characters (they cannot be part of a file name on every filesystem).

    Raises
    ------
    TypeError
        ``name`` is not a string.
    ValueError
        An empty name, or one with ``/`` or a control character.
    """
    rule = f"a {what} name must be a non-empty string without '/' or control characters"
    if not isinstance(name, str):
        raise TypeError(f"{rule}, got {type(name).__name__} {name!r}")
    if not name or "/" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"{rule}, got {name!r}")
    return name


def create_tag(store: NamedStore, name: str, version: str) -> None:
    """Tag ``version`` of ``store`` as ``name``; see :meth:`IcechunkParamStore.tag`."""
    import icechunk

    check_name(name, "tag")
    require_version(store, version)
    try:
        store._repo.create_tag(name, version)
    except icechunk.IcechunkError as e:
        raise translate(e, f"tagging version {version!r} as {name!r}") from None


def create_branch(store: NamedStore, name: str, version: str | None) -> None:
    """Create branch ``name`` of ``store`` at ``version`` (None: an empty branch); see
    :meth:`IcechunkParamStore.create_branch`."""
    import icechunk

    check_name(name, "branch")
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
