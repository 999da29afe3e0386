"""Removing the versions a :class:`~._retention.Retention` does not keep, with Icechunk's own tools.

Icechunk expires by age only: :meth:`icechunk.Repository.expire_snapshots` drops, from the history
of every branch and tag, the snapshots older than a cutoff, except those a branch or tag points at;
:meth:`icechunk.Repository.garbage_collect` then deletes what no branch or tag reaches.  So one
collection:

1. decides, per branch it manages, what the policy keeps (:func:`._retention.select`);
2. *pins* every kept version with a hidden branch ``vcdask.keep.<version>.<branch>`` (the newest too:
   its writer may commit meanwhile), unpins the versions it no longer keeps, and pins every version a
   reader holds (:func:`hold`) with ``vcdask.hold.<version>``: what is kept no longer depends on age;
3. takes as cutoff the oldest time another branch still needs that no ref keeps: for a branch with
   a writer's ``vcdask:keep_from_step`` marker (a running run: what it committed since its last
   collection, and what its tasks read), its versions from that step on; for a branch without a
   policy, its whole history (which holds back expiry in the whole store: see ``GCReport.held_back``);
   never later than when the collection listed the branches (less ``grace``);
4. expires the snapshots older than the cutoff, reads the holds again (a reader that came meanwhile
   gets its pin before anything is deleted), then garbage-collects objects older than ``grace``;
5. on a local disk, removes the empty folders that deleted branches leave under ``refs/`` (Icechunk deletes
   a ref's file, not its folder): its own pins', and any a collection before this release left.

A reader that holds a version (:func:`hold`) writes its hold first and then checks that the version
is still reachable: either a collection saw the hold before deleting anything, or the reader sees
that the version is gone.  Holds and pins are plain objects and refs: they work across processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from .. import config
from ..errors import VersionNotFoundError
from ._errors import translate
from ._history import HOLD_PREFIX, HistoryStore, is_reserved, parse_pin, pin_index, pin_name, reachable, read_branch
from ._names import NamedStore, check_listed, ref_entries, remove_empty_refs
from ._needs import KEEP_FROM_KEY, bound, idle, marker
from ._retention import GCReport, Retention, select
from ._runs import sweep_staged
from ._state import STATE_KEY, sweep_states
from ._version import version_id

if TYPE_CHECKING:
    from ._files import SideFiles
    from ._state import StateWriter
    from ._version import VersionInfo

__all__ = ["KEEP_FROM_KEY", "CollectedStore", "collect", "gc", "hold"]

logger = logging.getLogger(__name__)

HOLDS = "_holds"


class CollectedStore(HistoryStore, NamedStore, Protocol):
    """What a collection uses of an Icechunk-backed store (:class:`~vcdask.store.IcechunkParamStore`),
    besides what :class:`~._history.HistoryStore` reads.

    Attributes
    ----------
    _histories : dict
        Branch -> what a collection read of it, at its head then (see :func:`._needs.bound`), for the branches a
        collection does not manage.
    _state_writer : StateWriter
        The store's writer of rule state objects (told of the objects a sweep deletes).
    """

    _histories: dict[str, Any]
    _state_writer: StateWriter

    @property
    def files(self) -> SideFiles:
        """The store's side files (holds and rule state objects live there)."""

    def describe(self) -> str:
        """The store's location in words, for messages."""

    def versions(self, branch: str | None = None) -> list[VersionInfo]:
        """The branch's versions, newest first."""


# -- holds: readers that need a version for a while ------------------------------------------------
def _live_holds(store: CollectedStore, *, tidy: bool = True) -> set[str]:
    """Versions held by readers now (``tidy``: holds past their time are deleted)."""
    files, now, held = store.files, time.time(), set()
    for path in files.list(HOLDS):
        try:
            record = json.loads(files.get(path))
        except (FileNotFoundError, ValueError):
            continue  # released meanwhile, or being written
        if record.get("until", 0) < now:
            if tidy:
                files.delete(path)  # its reader died without releasing it
        else:
            held.add(record["version"])
    return held


@contextlib.contextmanager
def hold(store: CollectedStore, version: str, ttl: float) -> Iterator[str]:
    """Keep ``version`` from being collected while the block runs (see :meth:`ParamStore.hold`)."""
    version = version_id(version)
    path = f"{HOLDS}/{uuid.uuid4().hex}.json"
    store.files.put(path, json.dumps({"version": version, "until": time.time() + ttl}).encode())
    try:
        if not reachable(store, version):
            raise VersionNotFoundError(
                f"version {version!r} of {store.describe()} is gone or being collected (the retention "
                "policy does not keep it); hold or tag a version before it leaves the newest ones"
            )
        yield version
    finally:
        store.files.delete(path)


# -- one collection -----------------------------------------------------------------------------
def gc(
    store: CollectedStore,
    retention: Retention | None,
    *,
    branches: str | list[str] | None,
    dry_run: bool,
    in_use: Mapping[str, int | None] | None,
) -> GCReport:
    """:meth:`ParamStore.gc`: check the arguments, then :func:`collect`."""
    import icechunk

    chosen = [branches] if isinstance(branches, str) else None if branches is None else list(branches)
    for b in chosen or ():  # (each looked up: a run's own collection lists the branches once, in collect)
        if is_reserved(b) or not _has_branch(store._repo, b):
            names = store._repo.list_branches()
            raise VersionNotFoundError(
                f"no branch {b!r} in {store.describe()}; branches: {sorted(n for n in names if not is_reserved(n))}"
            )
    policy = Retention() if retention is None else retention
    if not isinstance(policy, Retention):
        raise TypeError(f"retention must be a vcdask.Retention (or None: the default policy), got {retention!r}")
    try:
        report = collect(store, policy, branches=chosen, in_use=dict(in_use or {}), dry_run=dry_run)
    except icechunk.IcechunkError as e:
        raise translate(e, f"collecting old versions in {store.describe()}") from None
    if in_use:  # a run's own collection, of its own branch: the runs' staged data goes at their ends
        return report
    staged = sweep_staged(store.files, chosen, default=policy.keep_staged_for, dry_run=dry_run)
    return replace(report, staged_removed=staged)


def collect(
    store: CollectedStore,
    retention: Retention,
    *,
    branches: list[str] | None,
    in_use: Mapping[str, int | None],
    dry_run: bool,
) -> GCReport:
    """One collection over ``store`` (see the module docstring); ``branches=None``: every branch.  Refused while
    the storage holds a tag or branch that Icechunk does not list (:func:`._names.check_listed`)."""
    import icechunk

    repo = store._repo
    grace = timedelta(seconds=retention.grace if retention.grace is not None else _default_grace(store))
    listed_at = datetime.now(UTC)  # anything committed after this is newer than the cutoff
    entries = ref_entries(store)  # (read before Icechunk lists them)
    fresh = repo.reopen()  # another process may have expired history since this one last looked
    listed, tags = fresh.list_branches(), fresh.list_tags()  # (the only listing, unless something is removed)
    empty = check_listed(store, entries, listed, tags, "collecting old versions")  # (deleted branches' folders)
    names = set(listed)
    tagged = {fresh.lookup_tag(t) for t in tags}
    held = _live_holds(store, tidy=not dry_run)
    managed = sorted(b for b in names if not is_reserved(b)) if branches is None else list(branches)
    # what each ref keeps: a pin's or a hold's version is in its name (vcdask makes them there, and never moves
    # them: no look-up of each); a managed branch's head is the first of the history read below; any other
    # branch is looked up once (a branch deleted since the listing is left out)
    heads = {n: v for n in names if (v := _named_version(n)) is not None}
    heads.update(_heads(fresh, names - set(managed) - set(heads)))
    by_branch = pin_index(names)
    report = GCReport(dry_run=dry_run)
    want_pins: dict[str, str] = {}  # pin name -> version: every kept version (its head too: it may move meanwhile)
    drops = {}
    for b in managed:
        try:
            head, versions = read_branch(store, fresh, b, by_branch.get(b, {}))
        except icechunk.IcechunkError as e:
            raise store._ref_error(e, branch=b) from None
        heads[b] = head.id
        if not versions:
            continue
        floor = in_use[b] if b in in_use else marker(head, listed_at, active_only=True)
        sel = select(versions, retention, tagged=tagged, in_use_step=floor)
        report.kept[b], drops[b] = [v.id for v in sel.keep], sel.drop
        want_pins.update((pin_name(v.id, b), v.id) for v in sel.keep)
    stale_pins = {n for n in names if (p := parse_pin(n)) is not None and p[1] in drops and n not in want_pins}
    unheld = {n for n in names if n.startswith(HOLD_PREFIX) and n[len(HOLD_PREFIX) :] not in held}
    # what keeps a version after this collection: not the pins it deletes (a version kept last time and
    # dropped now, or no longer held, is another branch's to keep, or gone)
    refs = {v for n, v in heads.items() if n not in stale_pins | unheld} | tagged | held | set(want_pins.values())
    bounds = [listed_at - grace]  # (the clocks of other writers may lag this one's)
    for b in sorted(names - set(managed)):
        if not is_reserved(b) and b in heads:
            bounds.extend(bound(store, fresh, b, heads[b], refs, listed_at, report))
    cutoff = min(bounds)
    for b, dropped in drops.items():
        report.removed[b] = [v.id for v in dropped if v.written_at < cutoff and v.id not in refs]
        report.deferred[b] = [v.id for v in dropped if v.id not in report.removed[b]]
    if dry_run:
        return report
    for name, version in want_pins.items():
        if name not in names:
            repo.create_branch(name, version)
    if any(report.removed.values()) or stale_pins or unheld or empty:
        # Under the lock: no vcdask commit (whose chunks no branch reaches yet) meanwhile, and no pin deleted by
        # another process's collection (its garbage collection lists the refs, then looks each up: a pin deleted
        # meanwhile failed it, "ref not found"; on a local disk, whose lock is real).
        with store._backend.commit_lock():
            unpinned = _pin_holds(repo, names, held) | stale_pins
            for name in stale_pins:
                _unpin(repo, name)
            if any(report.removed.values()) or unpinned:
                # a repository opened now: one kept open holds snapshots as they were read, whose parents an
                # earlier expiry rewrote and a garbage collection deleted (walked again, they are not found)
                now = repo.reopen()
                now.expire_snapshots(cutoff)
                unpinned |= _pin_holds(now, set(now.list_branches()), _live_holds(store))  # readers since
                summary = now.garbage_collect(datetime.now(UTC) - grace)
                deleted = summary.chunks_deleted + summary.manifests_deleted + summary.snapshots_deleted
                report = replace(
                    report,
                    bytes_deleted=summary.bytes_deleted,
                    objects_deleted=deleted + summary.transaction_logs_deleted,
                )
            remove_empty_refs(store, empty | {f"branch.{name}" for name in unpinned})
    else:
        _pin_holds(repo, names, held)  # (the pins of new holds: none to delete)
    for b in drops:  # by the branch's writer (between its commits), or on an idle branch
        if b in in_use:
            _sweep(store, b, None)
        elif _still_idle(store, fresh, b, heads[b], listed_at):
            _sweep(store, b, listed_at - grace)
    return report


def _heads(repo: Any, listed: set[str]) -> dict[str, str]:
    """Branch -> its head snapshot, of the branches ``listed``; a branch deleted between the listing and its
    look-up (another process deleted it meanwhile) is left out, not an error."""
    import icechunk

    heads = {}
    for branch in listed:
        try:
            heads[branch] = repo.lookup_branch(branch)
        except icechunk.IcechunkError:
            if branch in repo.reopen().list_branches():
                raise
    return heads


def _still_idle(store: CollectedStore, repo: Any, branch: str, head: str, now: datetime) -> bool:
    """Whether ``branch``, whose head was ``head`` when the collection listed it, is idle.  A writer may
    have committed on it since, and this collection expired and removed ``head`` (an old version now):
    then it is not idle."""
    import icechunk

    try:
        return idle(now, repo.lookup_snapshot(head).written_at)
    except icechunk.IcechunkError:
        if store._repo.reopen().lookup_branch(branch) != head:
            return False
        raise


def _sweep(store: CollectedStore, branch: str, written_before: datetime | None) -> None:
    """Delete the rule state objects of ``branch`` that its newest version does not name (only the
    newest version keeps its rule state).

    A writer writes its state object first and commits after, so an object no head names yet may be
    a commit's in progress (on an idle branch, a writer resuming on it).  Under the commit lock (a local
    store's: no commit is in progress while it is held) the head is looked up again; and with
    ``written_before`` only objects written before then go (object stores, which have no lock: the
    collection's grace, as for Icechunk's own objects).
    """
    with store._backend.commit_lock():
        repo = store._repo.reopen()
        head = repo.lookup_snapshot(repo.lookup_branch(branch))
        keep = (head.metadata or {}).get(STATE_KEY)
        before = None if written_before is None else written_before.timestamp()
        if sweep_states(store.files, branch, keep, written_before=before):
            store._state_writer.forget(branch)  # (this process's writer, if any, knew of objects now gone)


def _pin_holds(repo: Any, names: set[str], held: set[str]) -> set[str]:
    """A pin for every held version (even one already expired: it is there until collected); return the
    pins of released holds it removed."""
    import icechunk

    for version in held:
        name = f"{HOLD_PREFIX}{version}"
        if name not in names:
            try:
                repo.create_branch(name, version)
            except icechunk.IcechunkError:
                logger.debug("held version %s is gone already", version)
    released = {n for n in names if n.startswith(HOLD_PREFIX) and n[len(HOLD_PREFIX) :] not in held}
    for name in released:
        _unpin(repo, name)
    return released


def _unpin(repo: Any, name: str) -> None:
    """Delete a pin (another collection may have deleted it already)."""
    import icechunk

    try:
        repo.delete_branch(name)
    except icechunk.IcechunkError:
        if name in repo.list_branches():
            raise


def _named_version(name: str) -> str | None:
    """The version a pin or a hold keeps, from its name (None for any other branch)."""
    if name.startswith(HOLD_PREFIX):
        return name[len(HOLD_PREFIX) :]
    p = parse_pin(name)
    return None if p is None else p[0]


def _has_branch(repo: Any, branch: str) -> bool:
    import icechunk

    try:
        repo.lookup_branch(branch)
    except icechunk.IcechunkError:
        return branch in repo.list_branches()  # (a fault of the storage, not "no such branch": raised by the listing)
    return True


def _default_grace(store: CollectedStore) -> float:
    return 0.0 if getattr(store._backend, "locked_commits", False) else float(config.get("store.gc-grace"))
