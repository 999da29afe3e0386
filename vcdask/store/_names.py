"""Branches and tags of an Icechunk-backed store: the version a branch names (:meth:`IcechunkParamStore.head`),
making them (:meth:`IcechunkParamStore.tag`, :meth:`IcechunkParamStore.create_branch`), checking that
what they name is a vcdask version, and that Icechunk lists every ref the storage holds (:func:`check_listed`).

Icechunk keeps each ref under a key named after it (``refs/tag.<name>/ref.json``).  The object_store
library that its local, GCS and Azure storages use percent-encodes a key's non-ASCII and control characters
and ``"#%*<>?[\\]^`{|}~``; its S3 storage turns ``\\`` into a ``/``.  Such a ref is then missing from
Icechunk's listings (a tag) or listed by a name that it cannot look up (a branch): a collection would not
see the tag, and delete the version it keeps.  So a name holds only characters stored verbatim everywhere
(:data:`NAME_CHARACTERS`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol
from urllib.parse import unquote

from fsspec.implementations.local import LocalFileSystem

from ..errors import BranchExistsError, StoreError, VersionNotFoundError
from ._errors import translate
from ._history import is_reserved
from ._layout import is_version
from ._secrets import redact
from ._version import version_id

if TYPE_CHECKING:
    import icechunk

    from ._backend import StoreBackend

__all__ = [
    "MAX_NAME_LENGTH",
    "NAME_CHARACTERS",
    "NamedStore",
    "check_listed",
    "check_name",
    "create_branch",
    "create_tag",
    "head",
    "ref_entries",
    "remove_empty_refs",
    "require_version",
]

#: The characters of a branch or tag name, besides ASCII letters and digits: those that every storage keeps
#: verbatim in a ref's key (run ids, ``run-20260101-120000-4e2050``, are made of them).
NAME_CHARACTERS = " ._+:=@,-"
#: The longest branch or tag name: a ref's key is a file name on a local disk (at most 255 bytes), and a
#: kept version's pin is named ``vcdask.keep.<version>.<branch>`` (40 characters more).
MAX_NAME_LENGTH = 200
_NAME = re.compile(f"[A-Za-z0-9{re.escape(NAME_CHARACTERS)}]+")
# A ref's key below ``refs/``: ``<kind>.<name>/ref.json``, and ``ref.json.deleted`` beside it for a deleted tag.
_REF_KEY = re.compile(r"(branch|tag)\.(.+)/ref\.json(\.deleted)?")


class NamedStore(Protocol):
    """What this module uses of an Icechunk-backed store (:class:`~vcdask.store.IcechunkParamStore`):
    its repository, its backend, and its two helpers that put a snapshot or an Icechunk error about a
    name in vcdask's terms (a commit and a read use them too: :class:`~._commit.CommitStore`,
    :class:`~._read.ReadStore`).

    Attributes
    ----------
    max_tries : int
        Attempts per storage request.
    _repo : icechunk.Repository
        The store's repository.
    _backend : StoreBackend
        Its storage backend (for messages, and the listing of its refs).
    """

    max_tries: int
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

    A name is 1 to :data:`MAX_NAME_LENGTH` characters: ASCII letters, digits, and those of
    :data:`NAME_CHARACTERS` (space ``. _ + : = @ , -``), which every storage keeps verbatim in the ref's
    key (see the module docstring).

    Raises
    ------
    TypeError
        ``name`` is not a string.
    ValueError
        An empty name, one longer than :data:`MAX_NAME_LENGTH`, or one with another character.
    """
    rule = (
        f"a {what} name must be 1 to {MAX_NAME_LENGTH} characters: ASCII letters, digits, space and "
        f"{' '.join(NAME_CHARACTERS.strip())} (those every storage keeps verbatim in the {what}'s key)"
    )
    if not isinstance(name, str):
        raise TypeError(f"{rule}, got {type(name).__name__} {name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"{rule}, got {len(name)} characters: {name[:40]!r}...")
    if not _NAME.fullmatch(name):
        others = sorted({c for c in name if not _NAME.fullmatch(c)})
        why = f" (not {', '.join(map(repr, others))})" if others else ""
        raise ValueError(f"{rule}, got {name!r}{why}")
    return name


def ref_entries(store: NamedStore) -> set[str] | None:
    """The refs the storage holds, as ``<kind>.<name>`` with each name as stored, for :func:`check_listed`;
    None for a memory store (its storage is Icechunk's own memory).

    On a local disk the folders right under ``refs/`` (one directory read: a deleted branch leaves its folder,
    which a collection removes, :func:`remove_empty_refs`); on an object store every key under it (one listing:
    a deleted ref leaves no key, except a tag's, beside ``ref.json.deleted``), where a name may hold a ``/``.

    Raises
    ------
    StoreError
        The listing failed.
    """
    if store._backend.scheme == "memory":
        return None
    fs, root = store._backend.filesystem(max_tries=store.max_tries)
    try:
        if isinstance(fs, LocalFileSystem):
            return set(os.listdir(f"{root}/refs"))
        return {f"{kind}.{name}" for kind, name, _ in _parse(fs.find(f"{root}/refs"), f"{root}/refs")}
    except FileNotFoundError:
        return set()
    except OSError as e:
        raise StoreError(redact(f"listing the refs of {store._backend.describe()} failed: {e}")) from None


def check_listed(
    store: NamedStore, entries: set[str] | None, branches: Iterable[str], tags: Iterable[str], what: str
) -> set[str]:
    """Refuse to go on (``what``: e.g. a collection) while the storage holds a tag or branch that Icechunk does
    not list (one made by an earlier release, or with Icechunk itself, whose name is not stored verbatim):
    a collection would not see it, and would delete the version it keeps.

    Parameters
    ----------
    store : NamedStore
    entries : set of str or None
        :func:`ref_entries`, read before Icechunk listed ``branches`` and ``tags`` (a ref made meanwhile is
        in those).  The entries they leave out are looked into now: most hold no live ref (a local store keeps
        an empty folder for each deleted branch, such as a collection's old pins, and a deleted tag keeps its
        key beside ``ref.json.deleted``; a ref deleted meanwhile is gone); a live one is looked for in a new
        listing (a ref whose folder was made before Icechunk listed and its file after).  None: nothing to check.
    branches, tags : iterable of str
        What Icechunk lists.
    what : str
        What would go on, for the message.

    Returns
    -------
    set of str
        The entries of a local store's branches that Icechunk does not list and whose folders are empty (for
        :func:`remove_empty_refs`); empty elsewhere.

    Raises
    ------
    StoreError
        Such a ref is there (the message names it), or the listing failed.
    """
    if not entries:
        return set()
    fs, root = store._backend.filesystem(max_tries=store.max_tries)
    where, refs = store._backend.describe(), f"{root}/refs"
    left = entries - {f"branch.{b}" for b in branches} - {f"tag.{t}" for t in tags}
    unlisted, empty = [], set()
    try:
        for entry in left:
            keys = _keys(fs, refs, entry)
            unlisted.extend(_live_refs(keys, refs))
            if not keys and entry.startswith("branch.") and isinstance(fs, LocalFileSystem):
                empty.add(entry)
    except OSError as e:
        raise StoreError(redact(f"{what} in {where}: listing its refs failed: {e}")) from None
    if unlisted:  # (or made meanwhile: its folder was there before Icechunk listed the refs, its file after)
        now = store._repo.reopen()
        listed = {("branch", b) for b in now.list_branches()} | {("tag", t) for t in now.list_tags()}
        unlisted = [ref for ref in unlisted if ref not in listed]
    if not unlisted:
        return empty
    shown = ", ".join(f"{kind} {unquote(name)!r} (key refs/{kind}.{name})" for kind, name in sorted(unlisted))
    raise StoreError(
        f"{what} in {where}: refused, nothing was deleted: Icechunk does not list {shown}, so the versions they "
        f"keep would be deleted. Name those versions anew ({MAX_NAME_LENGTH} characters at most: ASCII letters, "
        f"digits, space and {' '.join(NAME_CHARACTERS.strip())}), e.g. store.tag(new_name, version), and delete "
        "the old refs with Icechunk (Repository.delete_tag, delete_branch)"
    )


def remove_empty_refs(store: NamedStore, entries: Iterable[str]) -> int:
    """Remove the empty folders ``refs/<entry>`` of a local store's deleted branches (``entries`` as
    :func:`ref_entries` names them); how many went.  Elsewhere nothing: a deleted branch leaves no key.

    Icechunk deletes a branch's ``ref.json`` and leaves its folder: each collection deletes pins, and a
    long-lived store gathered thousands of empty folders, which every listing of its branches reads (20,000
    made ``branches()`` take half a second, and a commit with its collection 3 s).  A folder is removed only if
    it is empty: another process may be making a branch of that name meanwhile (its ref is written in the folder,
    which it makes again if it is gone), and then the folder stays.
    """
    if store._backend.scheme == "memory":
        return 0
    fs, root = store._backend.filesystem(max_tries=store.max_tries)
    if not isinstance(fs, LocalFileSystem):
        return 0
    removed = 0
    for entry in entries:
        if not entry.startswith("branch."):
            continue
        try:
            os.rmdir(f"{root}/refs/{entry}")
        except OSError:  # not empty (a ref there: made meanwhile), or gone (another collection removed it)
            continue
        removed += 1
    return removed


def _keys(fs, refs: str, entry: str) -> list[str]:
    """The keys under ``refs/<entry>`` (none for an empty or missing folder)."""
    if isinstance(fs, LocalFileSystem):
        return [f"{folder}/{name}" for folder, _, names in os.walk(f"{refs}/{entry}", onerror=_raise) for name in names]
    return fs.find(f"{refs}/{entry}")


def _live_refs(keys: list[str], refs: str) -> list[tuple[str, str]]:
    """(kind, name as stored) of the live refs among ``keys`` (under ``refs``): none for a deleted one."""
    found = _parse(keys, refs)
    deleted = {(kind, name) for kind, name, gone in found if gone}
    return [(kind, name) for kind, name, gone in found if not gone and (kind, name) not in deleted]


def _parse(keys: Iterable[str], refs: str) -> list[tuple[str, str, bool]]:
    """(kind, name as stored, whether it is a deleted tag's marker) of the ref keys among ``keys`` (under ``refs``)."""
    found = (_REF_KEY.fullmatch(key[len(refs) :].lstrip("/")) for key in keys)
    return [(m[1], m[2], bool(m[3])) for m in found if m]


def _raise(e: OSError) -> None:
    if not isinstance(e, FileNotFoundError):  # (deleted meanwhile: nothing there)
        raise e


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
