"""Reading one version of an Icechunk-backed store (:meth:`IcechunkParamStore.read`).

The version is looked up by id, tag or branch (asked twice: Icechunk says "not found" for a fetch
that failed, too), its flat parameters are read in one round of requests (:mod:`._flatread`) while
their checksums are computed, and checked against those recorded at its commit (:mod:`._checksum`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..errors import VersionNotFoundError
from ._checksum import CHECKSUM_KEY, Hasher, recorded_piece, verify
from ._errors import translate
from ._flatread import Seen, read_flat
from ._history import HistoryStore, empty_branch_message
from ._layout import is_version, version_info
from ._names import NamedStore
from ._version import Checkpoint, version_id

if TYPE_CHECKING:
    import icechunk

__all__ = ["ReadStore", "read_version"]


class ReadStore(HistoryStore, NamedStore, Protocol):
    """What a read uses of an Icechunk-backed store (:class:`~vcdask.store.IcechunkParamStore`),
    besides its repository and backend (:class:`~._names.NamedStore`) and what
    :class:`~._history.HistoryStore` reads (for the message about an empty branch).

    Attributes
    ----------
    _seen : dict of str to Seen
        What the store's last read found (:func:`~._flatread.read_flat`).
    """

    _seen: dict[str, Seen]


def read_version(store: ReadStore, version: str | None, branch: str, tag: str | None) -> Checkpoint:
    """Read a version's parameters and metadata; see :meth:`IcechunkParamStore.read` for the arguments.

    Parameters
    ----------
    store : ReadStore
    version : str or None
        A version id (None: the tagged version, or the newest on ``branch``).
    branch : str
        The branch whose newest version to read when neither ``version`` nor ``tag`` is given.
    tag : str or None
        Read the version with this tag.

    Returns
    -------
    Checkpoint

    Raises
    ------
    VersionNotFoundError
        Unknown version, tag or branch, or a branch with no versions yet.
    StoreIntegrityError
        The parameters read are not those committed (their checksums differ).
    """
    import icechunk

    if version is not None and tag is not None:
        raise ValueError(f"give version or tag, not both (got version={version!r}, tag={tag!r})")
    for attempt in (1, 2):
        try:
            if tag is not None:
                session = store._repo.readonly_session(tag=tag)
            elif version is not None:
                session = store._repo.readonly_session(snapshot_id=version_id(version))
            else:
                session = store._repo.readonly_session(branch=branch)
            snap = store._repo.lookup_snapshot(session.snapshot_id)
            break
        except icechunk.IcechunkError as e:
            err = store._ref_error(e, version=version, tag=tag, branch=branch)
            if attempt == 1 and isinstance(err, VersionNotFoundError):
                continue  # ask once more: Icechunk says "not found" for a fetch that failed, too
            raise err from None
    if not is_version(snap):
        if tag is None and version is None:
            raise VersionNotFoundError(empty_branch_message(store, branch))
        raise VersionNotFoundError(f"{tag or version!r} in {store._backend.describe()} has no vcdask version yet")
    recorded = (snap.metadata or {}).get(CHECKSUM_KEY)
    piece = recorded_piece(recorded)
    hasher = None if piece is None else Hasher(piece)
    try:
        params = read_flat(session.store, store._seen, hasher=hasher)
    except icechunk.IcechunkError as e:
        raise translate(e, f"reading version {snap.id!r} from {store._backend.describe()}") from None
    verify(params, recorded, f"version {snap.id!r} of {store._backend.describe()}", hasher)
    return Checkpoint(version_info(snap, _parent_or_none(store, snap)), params)


def _parent_or_none(store: ReadStore, snap: icechunk.SnapshotInfo) -> str | None:
    """The version before ``snap``; None for the first, or for one collected since ``snap`` was
    looked up (a collection also rewrites the parent of the versions it keeps)."""
    import icechunk

    try:
        return store._version_or_none(snap.parent_id)
    except icechunk.IcechunkError as e:
        err = store._ref_error(e, version=snap.parent_id)
        if isinstance(err, VersionNotFoundError):
            return None
        raise err from None
