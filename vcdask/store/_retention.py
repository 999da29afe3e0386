"""Which versions a store keeps: the :class:`Retention` policy and its pure selection rule.

The policy is applied by :meth:`vcdask.ParamStore.gc` (and, during a run, by the run's merge
thread); this module only decides, over a branch's versions, which ones stay.  How the rest are
removed (Icechunk's expiry and garbage collection, pins, holds) is in :mod:`._collect`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._version import VersionInfo

__all__ = ["GCReport", "Retention", "check_retention", "select"]


def _count(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an integer >= 1" + (" or None" if optional else "")
        raise ValueError(f"Retention({name}={value!r}): {name} must be {allowed}")


def _seconds(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        allowed = "a finite number of seconds >= 0" + (" or None" if optional else "")
        raise ValueError(f"Retention({name}={value!r}): {name} must be {allowed}")


@dataclass(frozen=True)
class Retention:
    """Which versions of a branch a store keeps; the others are expired and their data deleted.

    A version is kept when it is one of the ``keep_last`` newest, tagged, the last version of an
    epoch (``keep_epochs``), the first of each block of ``every`` merges, or in use (a shard task
    or validation of a running run reads it, or a reader holds it with :meth:`ParamStore.hold`).
    Everything else is expired with Icechunk's own snapshot expiry and its chunks deleted with
    Icechunk's garbage collection.  ``vcdask.fit`` applies the default policy during the run;
    ``fit(retention=False)`` keeps every version.

    Parameters
    ----------
    keep_last : int, default 5
        Keep the newest ``keep_last`` versions of the branch (at least 1: the newest).
    keep_epochs : bool, default True
        Keep the last version of every epoch (by the versions' ``epoch`` metadata; a run's
        initial version is epoch 0's), and the version that ended each epoch of the run (by the
        newest version's ``progress``: an epoch that a shard given up completed ends at a version
        that merged a shard of the next epoch).
    every : int, optional
        Also keep the first version at or after every multiple of ``every`` merges (by the
        versions' ``step`` metadata), e.g. ``every=100`` keeps steps 0, 100, 200, ...
    interval : float, default 10.0
        During a run: collect every this many seconds (between merges, and once more when the run
        ends), sooner when ``backlog_bytes`` says so.
    grace : float, optional
        Never delete stored objects younger than this many seconds: they may belong to another
        writer's commit in progress.  Default: 0 for local directories and memory stores (every
        vcdask commit there holds the store's lock, which collection also takes), else
        ``vcdask.store.gc-grace`` (600 s: object stores have no lock, and their clocks may differ
        from this machine's).
    keep_staged_for : float, optional, default 604800
        Seconds (a week) that the copy of a run's in-memory or dask data staged in the store stays after the
        run ended (None: for good).  Only a resume reads it then: a run whose staged data went cannot be
        resumed or extended (its versions stay, and its model loads).  The run's end, and every :meth:`gc
        <vcdask.ParamStore.gc>`, removes the staged data of the runs whose time is up, each by its own
        policy (``gc`` by the one it is given); a nightly job's store holds a week of its data, not every
        night's.  Data read where it lives (a Zarr path or URL) is never staged, nor removed.
    backlog_bytes : int, optional, default 67108864
        64 MiB.  During a run: also collect as soon as the versions committed since the last
        collection hold this many bytes of parameters, before ``interval`` is up (``None``: by
        ``interval`` alone).  A run of a large model commits hundreds of megabytes a second;
        collected every 10 s, the store held gigabytes it was about to delete, which the machine
        had to find memory (and write-back) for, and each collection then deleted them at once: a
        5M-parameter run on a 2-core machine (vc-asgd) made 20-50% more merges a second this way
        (``benchmarks/merge_bound.py``, see the storage guide).  Whatever the backlog, the run
        waits nine times as long as its last collection took before the next one, so collecting
        never takes more than about a tenth of the merge thread's time.

    Raises
    ------
    ValueError
        A value out of range (the message names it and what is allowed).
    TypeError
        ``keep_epochs`` is not a bool.

    Examples
    --------
    >>> Retention()  # doctest: +ELLIPSIS
    Retention(keep_last=5, keep_epochs=True, every=None, interval=10.0, grace=None, backlog_bytes=67108864, ...)
    >>> Retention(keep_last=2, every=100)  # doctest: +ELLIPSIS
    Retention(keep_last=2, keep_epochs=True, every=100, ...)
    """

    keep_last: int = 5
    keep_epochs: bool = True
    every: int | None = None
    interval: float = 10.0
    grace: float | None = None
    backlog_bytes: int | None = 64 * 2**20
    keep_staged_for: float | None = 7 * 86400.0

    def __post_init__(self) -> None:
        _count("keep_last", self.keep_last)
        if not isinstance(self.keep_epochs, bool):
            raise TypeError(f"Retention(keep_epochs={self.keep_epochs!r}): keep_epochs must be True or False")
        _count("every", self.every, optional=True)
        _seconds("interval", self.interval)
        _seconds("grace", self.grace, optional=True)
        _count("backlog_bytes", self.backlog_bytes, optional=True)
        _seconds("keep_staged_for", self.keep_staged_for, optional=True)


def check_retention(retention: Any) -> Retention | None:
    """``fit(retention=...)``: None -> the default policy, False -> keep every version (None), or a Retention.

    Raises
    ------
    TypeError
        Anything else (the message names the accepted values).
    """
    if retention is None:
        return Retention()
    if retention is False:
        return None
    if isinstance(retention, Retention):
        return retention
    raise TypeError(
        f"retention must be None (the default policy), False (keep every version) or a vcdask.Retention, "
        f"got {retention!r}"
    )


@dataclass(frozen=True)
class Selection:
    """What :func:`select` decided for one branch."""

    keep: list[VersionInfo]  # newest first
    drop: list[VersionInfo]  # newest first


def select(
    versions: Sequence[VersionInfo],
    retention: Retention,
    *,
    tagged: Iterable[str] = (),
    in_use_step: int | None = None,
) -> Selection:
    """Decide which of a branch's versions (newest first) ``retention`` keeps.

    Parameters
    ----------
    versions : sequence of VersionInfo
        The branch's versions, newest first (its history and its pinned versions).
    retention : Retention
    tagged : iterable of str
        Version ids that have a tag.
    in_use_step : int, optional
        Versions with a ``step`` at or after this one are in use and kept.

    Returns
    -------
    Selection
    """
    if not versions:
        return Selection([], [])
    tags = set(tagged)
    last = min(retention.keep_last, len(versions)) - 1
    if in_use_step is not None:
        for i, v in enumerate(versions):
            step = v.metadata.get("step")
            if isinstance(step, int) and step >= in_use_step:
                last = max(last, i)
    keep = {v.id for v in versions[: last + 1]} | {v.id for v in versions if v.id in tags}
    if retention.keep_epochs:
        newest_of: dict[Any, str] = {}
        for v in versions:  # newest first: the first seen of each epoch is its last version
            epoch = v.metadata.get("epoch")
            if isinstance(epoch, int) and epoch not in newest_of:
                newest_of[epoch] = v.id
        keep |= set(newest_of.values())
        keep |= {v.id for v in versions if v.metadata.get("step") in _epoch_ends(versions[0])}
    if retention.every is not None:
        first_of: dict[int, str] = {}
        for v in reversed(versions):  # oldest first: the first seen of each block is its first version
            step = v.metadata.get("step")
            if isinstance(step, int) and step // retention.every not in first_of:
                first_of[step // retention.every] = v.id
        keep |= set(first_of.values())
    return Selection(keep=[v for v in versions if v.id in keep], drop=[v for v in versions if v.id not in keep])


def _epoch_ends(newest: VersionInfo) -> set[int]:
    """The steps at which the run's epochs ended, as the newest version's ``progress`` records them: an
    epoch a shard given up completed ends at a version whose own ``epoch`` may be the next one's."""
    progress = newest.metadata.get("progress")
    done = progress.get("done") if isinstance(progress, dict) else None
    ends = set()
    for entry in done if isinstance(done, list) else ():
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], int):
            ends.add(entry[1])
    return ends


@dataclass(frozen=True)
class GCReport:
    """What :meth:`ParamStore.gc` did (or, with ``dry_run=True``, would do).

    Attributes
    ----------
    kept : dict of str to list of str
        Branch -> the version ids it keeps, newest first.
    removed : dict of str to list of str
        Branch -> the version ids expired in this collection (or that would be), newest first.
    deferred : dict of str to list of str
        Branch -> versions the policy drops that stay for now, because another branch, a reader's
        hold or a version in use still needs the history they belong to; a later collection takes them.
    held_back : list of str
        Why some history could not be expired yet, in words (e.g. a branch that keeps everything).
    bytes_deleted : int
        Bytes of chunks, manifests and snapshots Icechunk deleted (0 in a dry run).
    objects_deleted : int
        Objects Icechunk deleted (chunks, manifests, snapshots, transaction logs).
    staged_removed : dict of str to int
        Run id -> bytes of its staged data removed (or that would be), its ``keep_staged_for`` up.
    dry_run : bool
    """

    kept: dict[str, list[str]] = field(default_factory=dict)
    removed: dict[str, list[str]] = field(default_factory=dict)
    deferred: dict[str, list[str]] = field(default_factory=dict)
    held_back: list[str] = field(default_factory=list)
    bytes_deleted: int = 0
    objects_deleted: int = 0
    staged_removed: dict[str, int] = field(default_factory=dict)
    dry_run: bool = False

    @property
    def n_removed(self) -> int:
        """How many versions were (or would be) removed, over all branches."""
        return sum(map(len, self.removed.values()))
