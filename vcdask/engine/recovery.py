"""Resuming a run whose scheduler died: what the store says (merged shards, finished epochs, pending
uploads), for the run's core to rebuild the run from (:class:`~vcdask.engine.core.messages.Resumed`).

:func:`read_back` is store I/O and runs in the run's merge thread, never on the event loop; :func:`recover`
feeds what it found to the core, and merges the uploads found, through the shell's ``step``.
"""

from __future__ import annotations

import logging
import math
import zipfile
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..updates import delete_update, list_updates, read_update_meta, update_gone, update_key
from .core import messages as m
from .end import progress_at, read_record, resumes_as_running
from .inflight import TaskRecord
from .progress import Progress

if TYPE_CHECKING:
    from ..spec import RunSpec
    from .lane import MergeLane

__all__ = ["read_back", "recover"]

logger = logging.getLogger(__name__)


def read_back(server, store, branch: str, run_id: str, n_shards: int):
    """Load ``server`` (a :class:`~vcdask.engine.params_server.ParamsServer`) from the branch head and
    read the run's history back from the store.

    What was merged comes from the newest version's ``progress`` record (which outlives the
    versions that retention removed) and from the ``merged`` lists of the versions still there
    (all of them for a run that keeps every version, or one written before ``progress`` existed).
    The run's record (written as epochs close and as a session ends) adds what the last session did after
    its last commit (a shard given up), the rows of the epochs it closed, and where it counted from.

    Returns
    -------
    Resumed
        What the run's core rebuilds the run from, with these fields:

    merged : dict epoch -> set of shards
        Every (epoch, shard) some committed version merged (from the versions' metadata).
    ends : dict epoch -> (step, version id)
        The version at which each fully merged epoch completed.
    attempts : dict (epoch, shard) -> int
        The next attempt number to use (keys of old attempts are never reused).
    pending : list of dict
        Records of updates uploaded but in no committed version, oldest base first (one trained from a
        draft base gets the id of the version that committed it, if kept: the server's bases by step
        went with the crash); the uploads of already merged shards are deleted.
    skipped : dict epoch -> set of shards
        The shards given up in the epochs not done (not trained again).
    rows : dict epoch -> dict
        The epoch rows of the last session (from its record), by epoch.
    resumed_at : int or None
        Where the target and patience count from, for a run whose scheduler died: where its last session
        counted from; None for one whose last session ended (extended, it counts from the epochs done).
    """
    server.load()
    last = read_record(store, run_id) or {}
    recorded = progress_at(last, server.head.version)  # (:func:`.end.progress_of`)
    if recorded is not None:
        server.progress = Progress.read({"progress": recorded}, server.progress.n_shards)
    server.progress.close_covered(server.head.step)
    rows = {int(r["epoch"]): r for r in last.get("epochs") or () if isinstance(r, dict) and "epoch" in r}
    merged: dict[int, set[int]] = {}
    attempts: dict[tuple[int, int], int] = {}
    ends: dict[int, tuple[int, str]] = {}
    versions = list(reversed(store.versions(branch)))  # oldest first
    for epoch, step in server.progress.done:
        merged[epoch] = set(range(n_shards))
        at_or_after = [v for v in versions if v.metadata.get("step", -1) >= step]  # the epoch's end, if kept
        ends[epoch] = (step, (at_or_after[0] if at_or_after else versions[-1]).id)

    def used(epoch: int, shard: int, attempt: int) -> None:  # the next attempt of (epoch, shard) comes after it
        attempts[(epoch, shard)] = max(attempts.get((epoch, shard), 0), attempt + 1)

    for epoch, shard, attempt in server.progress.open:
        merged.setdefault(epoch, set()).add(shard)
        used(epoch, shard, attempt)
    for info in versions:
        for epoch, shard, attempt in info.metadata.get("merged", []):
            merged.setdefault(epoch, set()).add(shard)
            used(epoch, shard, attempt)
            if len(merged[epoch]) == n_shards and epoch not in ends:
                ends[epoch] = (info.metadata["step"], info.id)
    pending = []
    for path in list_updates(store.files, run_id):
        named = update_key(path)  # every upload's attempt is used, torn or not: a worker still writing
        if named is not None:  # it after the crash would overwrite a new attempt's upload at that path
            used(*named)
        try:
            meta = read_update_meta(store.files, path)
        except (ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:  # torn: its shard is not merged
            logger.warning("run %s: leftover update %s unreadable (%s); its shard is trained again", run_id, path, e)
            meta = {}
        if not meta:  # not an update of this run's format: nothing to merge
            if update_gone("foreign", server.keep_updates):
                delete_update(store.files, path, strict=True)
            continue
        used(int(meta["epoch"]), int(meta["shard"]), int(meta.get("attempt", 0)))
        if meta["shard"] in merged.get(meta["epoch"], ()):  # merged and committed before the crash
            if update_gone("merged before a crash", server.keep_updates):
                delete_update(store.files, path, strict=True)
        else:
            pending.append(meta)
    pending.sort(key=lambda m: (m["epoch"], m["base_step"], m["shard"]))
    by_step = {info.metadata.get("step"): info.id for info in versions}
    for meta in pending:  # trained from a draft (its base had no version yet): the version committed since
        if meta.get("base_version") is None and meta.get("base_step") in by_step:
            meta["base_version"] = by_step[meta["base_step"]]
    skipped: dict[int, set[int]] = {}
    for epoch, shard in server.progress.skipped:
        if epoch not in ends and shard not in merged.get(epoch, ()):
            skipped.setdefault(epoch, set()).add(shard)
    resumed_at = None  # it ended (or an older vcdask ran it, without a record): extended, it counts from here
    if resumes_as_running(last):  # its last session died: it goes on counting as that session did
        resumed_at = int(last.get("resumed_at") or 0)
    return m.Resumed(merged, ends, attempts, tuple(pending), skipped, rows, resumed_at)


async def recover(lane: MergeLane, store: Any, spec: RunSpec, step: Callable[[m.Event], Awaitable[Any]]) -> None:
    """Rebuild a run from its branch and its folder (after the scheduler that drove it died): ``W_s`` and
    the merged (epoch, shard) from the versions' metadata (:func:`read_back`, in the merge thread), then
    merge the uploads that no committed version contains.  ``step`` hands an event to the run's core and
    carries out its effects (:meth:`vcdask.engine.run.Run.step`)."""
    resumed = await lane.call(read_back, lane.server, store, spec.branch, spec.run_id, spec.shards.n_shards)
    await step(resumed)
    logger.info(
        "run %s resumed at step %d: %d updates merged before, %d uploaded but unmerged",
        spec.run_id,
        lane.head.step,
        sum(map(len, resumed.merged.values())),
        len(resumed.pending),
    )
    for meta in resumed.pending:
        rec = {"seconds": math.nan, "upload_seconds": math.nan, **meta}
        task = TaskRecord("update", meta["epoch"], meta["shard"], meta["attempt"], meta["base_step"])
        await step(m.Result(task, rec, taken=True))
    await step(m.CloseEpochs())
