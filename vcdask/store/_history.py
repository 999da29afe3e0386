"""Reading what a store holds after retention: a branch's versions (its history and its pinned
versions), whether a version is still reachable, and sizes.

Expiry edits history (the oldest version a branch keeps gets the repository's root as parent),
and Icechunk caches the snapshots it read per repository object: a process that read history
before another process expired it would still see the old one.  So everything here reads
through a fresh :meth:`icechunk.Repository.reopen` (no I/O; an empty cache).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from .._stack import user_level
from ..errors import StoreNotFoundError, VersionNotFoundError
from ._layout import is_version, version_info
from ._version import VersionInfo, version_id

if TYPE_CHECKING:
    import icechunk
    from fsspec import AbstractFileSystem

    from ._backend import StoreBackend

__all__ = [
    "HOLD_PREFIX",
    "PIN_PREFIX",
    "HistoryStore",
    "branch_names",
    "branch_pins",
    "empty_branch_message",
    "history",
    "is_reserved",
    "parse_pin",
    "pin_index",
    "pin_name",
    "pins",
    "point_to_runs",
    "reachable",
    "read_branch",
    "store_nbytes",
    "version_nbytes",
    "versions_of",
]

#: Hidden branches that keep a version for a branch's retention policy, and for a reader's hold.
PIN_PREFIX = "vcdask.keep."
HOLD_PREFIX = "vcdask.hold."


class HistoryStore(Protocol):
    """What this module reads of an Icechunk-backed store (:class:`~vcdask.store.IcechunkParamStore`).

    Attributes
    ----------
    location : str
        The store's location.
    max_tries : int
        Attempts per storage request.
    _repo : icechunk.Repository
        The store's repository.
    _backend : StoreBackend
        Its storage backend.
    _pinned : dict of str to VersionInfo
        Pinned versions read so far (a pinned version never changes).
    """

    location: str
    max_tries: int
    _repo: icechunk.Repository
    _backend: StoreBackend
    _pinned: dict[str, VersionInfo]

    def branches(self) -> dict[str, str | None]:
        """Branch name -> newest version id (None for an empty branch)."""


def is_reserved(branch: str) -> bool:
    """Whether ``branch`` is one of the store's own pins (hidden from :meth:`ParamStore.branches`)."""
    return branch.startswith((PIN_PREFIX, HOLD_PREFIX))


def pin_name(version: str, branch: str) -> str:
    """The hidden branch that keeps ``version`` for ``branch``'s policy."""
    return f"{PIN_PREFIX}{version}.{branch}"


def parse_pin(name: str) -> tuple[str, str] | None:
    """(version, branch) of a pin made by :func:`pin_name`; None for any other branch name."""
    rest = name[len(PIN_PREFIX) :]
    if not name.startswith(PIN_PREFIX) or "." not in rest:
        return None
    version, branch = rest.split(".", 1)  # version ids have no dots; branch names may
    return version, branch


def pins(names: Iterable[str], branch: str) -> dict[str, str]:
    """Version id -> pin name, of the pins among ``names`` that keep versions of ``branch``."""
    return {p[0]: name for name in names if (p := parse_pin(name)) is not None and p[1] == branch}


def pin_index(names: Iterable[str]) -> dict[str, dict[str, str]]:
    """Branch -> (version id -> pin name), of every pin among ``names``: one pass over one listing, for
    a collection (or a listing of runs) that reads several branches (not a parse of every name per branch)."""
    index: dict[str, dict[str, str]] = {}
    for name in names:
        if (p := parse_pin(name)) is not None:
            index.setdefault(p[1], {})[p[0]] = name
    return index


def branch_pins(store: HistoryStore, repo: icechunk.Repository, branch: str) -> dict[str, str]:
    """Version id -> pin name, of the pins that keep versions of ``branch`` now.

    Icechunk lists a local store's branches at about 0.1 ms each, and a store of 300 runs holds 1800 (each
    run's branch and the pins of its kept versions): one branch's versions took 100 ms, most of them listing
    the other runs' pins.  On a local disk the folders under ``refs/`` (one directory read: a millisecond)
    name the candidates, and each of this branch's is looked up (a deleted branch leaves its folder until a
    collection removes it); elsewhere, or for a name not stored verbatim in a key, one listing."""
    import icechunk

    entries = _local_refs(store)
    if entries is None or not _VERBATIM.fullmatch(branch):
        return pins(repo.list_branches(), branch)
    found = {}
    for entry in entries:
        p = parse_pin(entry[len("branch.") :]) if entry.startswith(f"branch.{PIN_PREFIX}") else None
        if p is None or p[1] != branch:
            continue
        name = entry[len("branch.") :]
        try:
            repo.lookup_branch(name)
        except icechunk.IcechunkError:  # deleted (its folder stays until a collection removes it)
            continue
        found[p[0]] = name
    return found


#: A name that every storage keeps verbatim in a ref's key (``_names.NAME_CHARACTERS``: vcdask's branches).
_VERBATIM = re.compile(r"[A-Za-z0-9 ._+:=@,-]+")


def _local_refs(store: HistoryStore) -> list[str] | None:
    """The entries under a local store's ``refs/`` (None elsewhere)."""
    from fsspec.implementations.local import LocalFileSystem

    if store._backend.scheme == "memory":
        return None
    fs, root = store._backend.filesystem(max_tries=store.max_tries)
    if not isinstance(fs, LocalFileSystem):
        return None
    try:
        return os.listdir(f"{root}/refs")
    except FileNotFoundError:
        return []


def history(
    store: HistoryStore,
    branch: str,
    *,
    repo: icechunk.Repository | None = None,
    pinned: dict[str, str] | None = None,
) -> list[VersionInfo]:
    """The versions of ``branch``, newest first: its history, and the older versions pinned for it.

    ``repo``: a repository reopened for this read (default: a fresh one); ``pinned``: the pins of ``branch``
    (version id -> pin name), from a listing made for several branches at once (default: :func:`branch_pins`)."""
    return read_branch(store, store._repo.reopen() if repo is None else repo, branch, pinned)[1]


def branch_names(store: HistoryStore) -> set[str]:
    """Every branch of ``store``, its pins and holds too (one listing, no look-up of each)."""
    return set(store._repo.list_branches())


def versions_of(store: HistoryStore, branches: Iterable[str], names: Iterable[str]) -> dict[str, list[VersionInfo]]:
    """Branch -> its versions (as :func:`history` reads them), for each of ``branches``, their pins found in
    ``names`` (:func:`branch_names`: one listing for them all, e.g. ``vcdask runs``).  A branch that cannot be
    read (deleted since ``names`` was listed) is left out: :meth:`~vcdask.ParamStore.versions` says why."""
    import icechunk

    repo, index, out = store._repo.reopen(), pin_index(names), {}
    for branch in branches:
        try:
            out[branch] = history(store, branch, repo=repo, pinned=index.get(branch, {}))
        except icechunk.IcechunkError:
            continue
    return out


def read_branch(
    store: HistoryStore, repo: icechunk.Repository, branch: str, pinned: dict[str, str] | None = None
) -> tuple[icechunk.SnapshotInfo, list[VersionInfo]]:
    """(``branch``'s head snapshot, its versions as :func:`history` gives them), read from ``repo``; a pinned
    version gone since ``pinned`` was listed is left out."""
    import icechunk

    from ._errors import translate

    ancestry = list(repo.ancestry(branch=branch))
    snaps = [s for s in ancestry if is_version(s)]
    out = [version_info(s, snaps[i + 1].id if i + 1 < len(snaps) else None) for i, s in enumerate(snaps)]
    seen = {v.id for v in out}
    for version in (branch_pins(store, repo, branch) if pinned is None else pinned).keys() - seen:
        info = store._pinned.get(version)
        if info is None:  # a pinned version never changes: read once per process
            try:
                info = store._pinned[version] = version_info(repo.lookup_snapshot(version), None)
            except icechunk.IcechunkError as e:
                if not isinstance(translate(e, version), (VersionNotFoundError, StoreNotFoundError)):
                    raise
                continue  # unpinned and deleted since the pins were listed (a run's own collection, meanwhile)
        out.append(info)
    return ancestry[0], sorted(out, key=lambda v: v.written_at, reverse=True)


def reachable(store: HistoryStore, version: str) -> bool:
    """Whether a branch or tag still reaches ``version`` (so no collection can delete it unseen)."""
    import icechunk

    repo = store._repo.reopen()
    try:
        when = repo.lookup_snapshot(version).written_at
        names = repo.list_branches()
        if version in {repo.lookup_branch(b) for b in names} | {repo.lookup_tag(t) for t in repo.list_tags()}:
            return True
        for b in names:
            for snap in repo.ancestry(branch=b):
                if snap.id == version:
                    return True
                if snap.written_at < when:
                    break
    except icechunk.IcechunkError:
        return False
    return False


def version_nbytes(store: HistoryStore, version: str) -> int:
    """Bytes of one version's parameter arrays as stored (uncompressed chunks; metadata only is read)."""
    import zarr
    from zarr.errors import GroupNotFoundError

    session = store._repo.readonly_session(snapshot_id=version_id(version))
    try:
        group = zarr.open_group(session.store, mode="r", path="params")
    except GroupNotFoundError:  # a snapshot that is not a vcdask version (the repository's root)
        raise VersionNotFoundError(f"{version!r} is not a vcdask version of {store._backend.describe()}") from None
    return sum(int(a.nbytes) for _, a in group.arrays())


def store_nbytes(store: HistoryStore) -> int:
    """Bytes of every object of the store: versions, Icechunk's metadata and the side files.

    Best effort while a run writes to the store: an object it removes while they are counted (a merged
    update, an expired snapshot, a moved branch's old ref) is left out, never an error."""
    fs, root = store._backend.filesystem(max_tries=store.max_tries)
    total = _tree_nbytes(fs, root)
    if store._backend.scheme == "memory":  # the repository itself lives in Icechunk's memory storage
        total += int(store._repo.chunk_storage_stats().native_bytes)
    return total


#: How often the size of a store that is not local is counted again when an object goes while it is listed.
SIZE_TRIES = 3


def _tree_nbytes(fs: AbstractFileSystem, root: str) -> int:
    """Bytes of the objects under ``root``.  A local tree is walked entry by entry, each entry that goes
    meanwhile skipped (fsspec's ``du`` stats every file it listed, and one that a run deleted in between
    raised FileNotFoundError); an object store's listing gives the sizes itself, and is listed again when
    a prefix goes while it is listed."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        return _local_nbytes(fs._strip_protocol(root))
    tries = 1
    while True:
        try:
            return int(fs.du(root, total=True)) if fs.exists(root) else 0
        except FileNotFoundError:
            if tries == SIZE_TRIES:
                raise
            tries += 1


def _local_nbytes(top: str) -> int:
    total, folders = 0, [top]
    while folders:
        try:
            with os.scandir(folders.pop()) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            folders.append(entry.path)
                        else:
                            total += entry.stat().st_size
                    except FileNotFoundError:  # removed since the folder was listed
                        continue
        except (FileNotFoundError, NotADirectoryError):  # removed (or replaced) since its parent was listed
            continue
    return total


def empty_branch_message(store: HistoryStore, branch: str) -> str:
    """Why ``branch`` has nothing to read, and which branches do (runs write their own, never ``main``)."""
    heads = {b: v for b, v in store.branches().items() if v is not None and b != branch}
    where = f"branch {branch!r} of {store._backend.describe()} has no vcdask version yet"
    if not heads:
        return f"{where}, and no other branch has one: nothing was committed to this store"
    newest = sorted(heads, key=lambda b: store._repo.lookup_snapshot(heads[b]).written_at, reverse=True)
    shown = ", ".join(newest[:5]) + (f" and {len(newest) - 5} more" if len(newest) > 5 else "")
    return (
        f"{where}; every run writes its own branch (its run_id), newest first: {shown}. Read one with "
        f"branch={newest[0]!r} (vcdask.load(store, branch=...)), or list them with `vcdask runs STORE`"
    )


def point_to_runs(store: HistoryStore) -> None:
    """Warn that an empty ``"main"`` is not where a run's versions are: every run writes its own branch
    (its run id); the newest is named (``vcdask versions STORE`` lists that one by default)."""
    runs = sorted(b for b in store.branches() if b.startswith("run-"))
    if runs:
        import warnings

        warnings.warn(
            f"branch 'main' of {store.location!r} has no versions: every run writes its own branch "
            f"(its run id), newest {runs[-1]!r}: store.versions({runs[-1]!r})",
            UserWarning,
            stacklevel=user_level(),
        )
