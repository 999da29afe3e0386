"""What a collection must not expire of the branches it does not manage (:func:`bound`): the oldest time each
still needs, read once per head and process (:class:`Needs`), and a writer's ``keep_from`` marker
(:data:`KEEP_FROM_KEY`, :func:`marker`); see :mod:`._collect`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from .. import config
from ._layout import is_version

if TYPE_CHECKING:
    from ._retention import GCReport

__all__ = ["KEEP_FROM_KEY", "Needs", "Remembers", "bound", "idle", "marker"]


class Remembers(Protocol):
    """A store that keeps what collections read of the branches they do not manage (:class:`Needs`)."""

    _histories: dict[str, Any]


#: Version metadata: versions of this branch at or after this step may still be needed by its writer.
KEEP_FROM_KEY = "vcdask:keep_from_step"


def marker(head: Any, now: datetime, *, active_only: bool) -> int | None:
    """The ``keep_from_step`` marker of a branch's newest version, ``head`` (a snapshot: None without one, or
    when stale)."""
    step = (head.metadata or {}).get(KEEP_FROM_KEY)
    if not isinstance(step, int):
        return None
    if active_only and idle(now, head.written_at):
        return None
    return step


@dataclass
class Needs:
    """What a collection read of a branch it does not manage, at one head (a head's snapshot never changes;
    expiry only ever takes versions out of the history behind it)."""

    head: str
    step: int | None  # the head's keep_from marker
    written_at: datetime  # the head's
    history: list[tuple[str, datetime]] | None = None  # (version, written at) from the marker on, newest first


def bound(
    store: Remembers, repo: Any, branch: str, head: str, refs: set[str], now: datetime, report: GCReport
) -> list[datetime]:
    """The oldest time a branch this collection does not manage, whose newest snapshot is ``head``, still needs
    (empty: it needs nothing).

    With a writer's marker: its versions from that step on that nothing else keeps (what its writer
    committed since it last collected, and what its tasks read).  Without one: its whole history.  Its head is
    read once per head and process (a run's own collection looks at every other run's branch: one look-up of
    its ref each, and no more while it does not move); the history behind it is read then, and again when a
    version it lists is not kept by a ref (a marker's versions: each such time, since expiry may have taken
    some out; a whole history, which holds back expiry in the whole store: once the oldest version it holds
    back is gone, i.e. someone applied a policy to it).  What a branch whose versions refs keep needs is read
    no more: expiry only takes versions out of a history, so none that it lists later is missing here.
    """
    seen = store._histories.get(branch)
    if not isinstance(seen, Needs) or seen.head != head:
        snap = repo.lookup_snapshot(head)
        seen = store._histories[branch] = Needs(head, marker(snap, now, active_only=False), snap.written_at)
    step = seen.step
    oldest = _oldest(seen.history or [], refs)
    if seen.history is None or (oldest is not None and (step is not None or not _exists(repo, oldest[0]))):
        history = []
        for snap in repo.ancestry(branch=branch):
            if not is_version(snap) or (step is not None and (snap.metadata or {}).get("step", step) < step):
                break
            history.append((snap.id, snap.written_at))
        seen.history = history
        oldest = _oldest(history, refs)
    if oldest is None:
        return []
    when = oldest[1]
    if step is None:
        why = "it keeps its whole history (no retention policy)"
    elif idle(now, seen.written_at):
        why = "its run stopped before it could apply its retention policy"
    else:
        return [when]  # a running run: it collects itself soon
    report.held_back.append(
        f"branch {branch!r} holds back expiry of everything written after {when:%Y-%m-%d %H:%M:%S} UTC: {why}; "
        "apply a policy to it with ParamStore.gc(branches=...) or `vcdask gc STORE --branch ...`"
    )
    return [when]


def _oldest(history: list[tuple[str, datetime]], refs: set[str]) -> tuple[str, datetime] | None:
    """The oldest (version, time) of ``history`` (newest first) that no ref keeps."""
    return next((entry for entry in reversed(history) if entry[0] not in refs), None)


def _exists(repo: Any, version: str) -> bool:
    import icechunk

    try:
        repo.lookup_snapshot(version)
    except icechunk.IcechunkError:
        return False
    return True


def idle(now: datetime, written_at: datetime) -> bool:
    """A branch whose newest version was written at ``written_at`` is idle (``vcdask.store.idle-after``):
    its writer's marker no longer counts, and any collection may sweep its rule state."""
    return (now - written_at).total_seconds() > float(config.get("store.idle-after"))
