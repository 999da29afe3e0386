"""What a store keeps of each run beside its repository, under ``runs/<run_id>/``, and when a run's staged
data goes.

A run of in-memory or dask data stages a copy of it in the store (``train.zarr``, ``validation.zarr``): a
worker anywhere reads it there, and a resume needs it.  Once the run has ended, nothing but a resume reads
it; a run's :class:`~._retention.Retention` says how long it stays after that (``keep_staged_for``), and
the run's record (``status.json``) carries that time, the run's end and the paths it staged.  Each run's
end, and every :meth:`ParamStore.gc <vcdask.ParamStore.gc>` (``vcdask gc``), removes the staged data of the
runs whose time is up: a store used by a nightly job holds its last week's data, not every night's.

A run whose data went cannot be resumed: a marker (``staged-removed.json``) is written before anything is
deleted, and :func:`check_staged` refuses such a resume with what to do instead.  The marker is written,
then the run's record read again: a resume that started meanwhile (its record says ``running``) keeps its
data, and the marker goes.  The versions, tags and spec stay: the run's model loads as before.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Literal

__all__ = ["ENDED", "check_staged", "record_path", "staged_paths", "sweep_staged"]

logger = logging.getLogger(__name__)

#: The statuses of a run that has ended, as its record says them (not ``running``, nor ``incomplete``: a run
#: whose scheduler went away, which :func:`vcdask.resume` is there to continue).
ENDED = frozenset({"finished", "stopped", "cancelled", "failed"})
#: Where ``vcdask.fit`` stages a run's data, beside its record.
STAGED_NAMES = ("train.zarr", "validation.zarr")
#: The marker of a run whose staged data a collection removed (beside its record).
GONE = "staged-removed.json"


def record_path(run_id: str) -> str:
    """Where a run's record lives (small JSON: status, why it stopped, epochs, final metrics; written by
    the engine when the run starts, as epochs close and when it ends), relative to ``<store>/runs``; read it
    with :func:`vcdask.engine.end.read_record`, never unpickling anything."""
    return f"{run_id}/status.json"


def staged_paths(sources: Iterable[Any]) -> list[str]:
    """The paths (relative to ``<store>/runs``) of the staged groups among a run's data ``sources``
    (:class:`~vcdask.data.DataSource`; data read where it lives has none)."""
    return [s.path for s in sources if getattr(s, "store", None) is not None and getattr(s, "path", None)]


def _read(files: Any, path: str) -> dict[str, Any] | None:
    try:
        return _loads(files.get(path))
    except FileNotFoundError:
        return None


def check_staged(files: Any, run_id: str) -> None:
    """Refuse to resume ``run_id`` when a collection removed its staged data.

    Raises
    ------
    FileNotFoundError
        The staged data is gone: when, after what time, and how to train the run's model on again.
    """
    gone = _read(files, f"{run_id}/{GONE}")
    if gone is None:
        return
    when = datetime.fromtimestamp(float(gone.get("removed_at", 0)), UTC).strftime("%Y-%m-%d %H:%M UTC")
    kept, by = gone.get("keep_staged_for"), gone.get("by", "a collection")
    raise FileNotFoundError(
        f"run {run_id!r} cannot be resumed: the copy of its data staged in the store was removed on {when}, "
        f"{_days(kept)} after the run ended ({by}, keep_staged_for={kept!r}). Its versions are there: "
        f"train its model on from where it stopped with vcdask.fit(vcdask.load(store, branch={run_id!r}), data, "
        "...), or keep staged data longer with fit(retention=vcdask.Retention(keep_staged_for=None))"
    )


def _days(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "some time"
    return f"{seconds / 86400:g} days" if seconds >= 86400 else f"{seconds:g} s"


def sweep_staged(
    files: Any,
    runs: Iterable[str] | None = None,
    *,
    default: float | None = None,
    override: float | None | Literal["no"] = "no",
    dry_run: bool = False,
    now: float | None = None,
) -> dict[str, int]:
    """Remove the staged data of the ended runs whose time is up; return run id -> bytes removed (or that
    would be, with ``dry_run``).

    Parameters
    ----------
    files : SideFiles
        The store's side files.
    runs : iterable of str, optional
        The runs to look at (default: every run folder of the store).
    default : float or None, optional
        Seconds after its end that the staged data of a run that recorded no time of its own stays (a run of a
        vcdask before this, which staged its data as :data:`STAGED_NAMES`); None: for good.
    override : float or None, optional
        Seconds for every run, whatever it recorded (``vcdask gc --keep-staged-days``); None: for good.
        Default: each run by its own record's ``keep_staged_for`` (its ``Retention``; ``retention=False``:
        for good).
    dry_run : bool, default False
    now : float, optional
        POSIX seconds (default: now).
    """
    now = time.time() if now is None else now
    names = files.folders() if runs is None else list(runs)
    # the records, and the markers of runs whose data went before: one round of reads (concurrent on an object
    # store), not a listing of each run's staged folders at every run's end
    found = files.get_many([p for r in names for p in (record_path(r), f"{r}/{GONE}")])
    removed: dict[str, int] = {}
    for run_id in names:
        rec = _loads(found.get(record_path(run_id)))
        if rec is None or f"{run_id}/{GONE}" in found or rec.get("status") not in ENDED:
            continue
        # (a run of a vcdask before this recorded no paths: it staged its data there, if it staged any)
        listed = rec.get("staged", [f"{run_id}/{name}" for name in STAGED_NAMES])
        if not isinstance(listed, list) or not listed:
            continue
        own = "keep_staged_for" in rec
        policy = override if override != "no" else rec["keep_staged_for"] if own else default
        ended = rec.get("ended")
        if not isinstance(policy, (int, float)) or not isinstance(ended, (int, float)) or ended + policy > now:
            continue
        staged = [p for p in listed if isinstance(p, str) and p.startswith(f"{run_id}/")]
        there = {p: files.nbytes(p) for p in staged}
        if all(n is None for n in there.values()):
            continue  # (removed by hand)
        removed[run_id] = sum(n or 0 for n in there.values())
        if dry_run:
            continue
        by = "its own Retention" if override == "no" and own else "a collection"
        marker = f"{run_id}/{GONE}"
        files.put(marker, json.dumps({"removed_at": now, "ended": ended, "keep_staged_for": policy, "by": by}).encode())
        again = _read(files, record_path(run_id)) or {}
        if again.get("status") not in ENDED or again.get("ended") != ended:  # resumed meanwhile: it needs them
            files.delete(marker)
            del removed[run_id]
            continue
        for path in staged:
            files.delete_tree(path)
        logger.info("run %s: removed its staged data (%d bytes), %g s after it ended", run_id, removed[run_id], policy)
    return removed


def _loads(data: bytes | None) -> dict[str, Any] | None:
    """A JSON object, or None for nothing, or what does not read as one (cut short by an older vcdask's crash)."""
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
