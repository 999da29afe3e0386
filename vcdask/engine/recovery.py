"""Resuming a run whose scheduler died: what the store says (merged shards, finished epochs, pending
uploads), and the run rebuilt from it.

:func:`read_back` is store I/O and runs in the run's merge thread, never on the event loop.
"""

from __future__ import annotations

import logging
import zipfile
from typing import TYPE_CHECKING

from ..updates import delete_update, list_updates, read_update_meta
from . import arrivals
from .inflight import TaskRecord

if TYPE_CHECKING:
    from .run import Run

__all__ = ["read_back", "recover"]

logger = logging.getLogger(__name__)


def read_back(server, store, branch: str, run_id: str, n_shards: int):
    """Load ``server`` (a :class:`~vcdask.engine.params_server.ParamsServer`) from the branch head and
    read the run's history back from the store.

    What was merged comes from the newest version's ``progress`` record (which outlives the
    versions that retention removed) and from the ``merged`` lists of the versions still there
    (all of them for a run that keeps every version, or one written before ``progress`` existed).

    Returns
    -------
    merged : dict epoch -> set of shards
        Every (epoch, shard) some committed version merged (from the versions' metadata).
    ends : dict epoch -> (step, version id)
        The version at which each fully merged epoch completed.
    attempts : dict (epoch, shard) -> int
        The next attempt number to use (keys of old attempts are never reused).
    pending : list of dict
        Records of updates uploaded but in no committed version, oldest base first; the
        uploads of already merged shards are deleted.
    """
    server.load()
    merged: dict[int, set[int]] = {}
    attempts: dict[tuple[int, int], int] = {}
    ends: dict[int, tuple[int, str]] = {}
    versions = list(reversed(store.versions(branch)))  # oldest first
    for epoch, step in server.progress["done"]:
        merged[epoch] = set(range(n_shards))
        at_or_after = [v for v in versions if v.metadata.get("step", -1) >= step]  # the epoch's end, if kept
        ends[epoch] = (step, (at_or_after[0] if at_or_after else versions[-1]).id)
    for epoch, shard, attempt in server.progress["open"]:
        merged.setdefault(epoch, set()).add(shard)
        attempts[(epoch, shard)] = max(attempts.get((epoch, shard), 0), attempt + 1)
    for info in versions:
        for epoch, shard, attempt in info.metadata.get("merged", []):
            merged.setdefault(epoch, set()).add(shard)
            attempts[(epoch, shard)] = max(attempts.get((epoch, shard), 0), attempt + 1)
            if len(merged[epoch]) == n_shards and epoch not in ends:
                ends[epoch] = (info.metadata["step"], info.id)
    pending = []
    for path in list_updates(store.files, run_id):
        try:
            meta = read_update_meta(store.files, path)
        except (ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:  # torn: its shard is not merged
            logger.warning("run %s: leftover update %s unreadable (%s); its shard is trained again", run_id, path, e)
            meta = {}
        if not meta:  # not an update of this run's format: nothing to merge
            delete_update(store.files, path, strict=True)
            continue
        key = (int(meta["epoch"]), int(meta["shard"]))
        attempts[key] = max(attempts.get(key, 0), meta.get("attempt", 0) + 1)
        if meta["shard"] in merged.get(meta["epoch"], ()):
            delete_update(store.files, path, strict=True)  # merged and committed before the crash
        else:
            pending.append(meta)
    pending.sort(key=lambda m: (m["epoch"], m["base_step"], m["shard"]))
    return merged, ends, attempts, pending


async def recover(run: Run) -> None:
    """Rebuild the run from its branch and its folder (after the scheduler that drove it died):
    ``W_s`` and the merged (epoch, shard) from the versions' metadata, then merge the uploads
    that no committed version contains."""
    n = run.spec.shards.n_shards
    merged, ends, attempts, pending = await run.lane.call(read_back, run.server, run.store, run.spec.branch, run.id, n)
    run.ledger.merged = merged
    run.ledger.resumed_at = max(ends, default=0)  # early stopping's patience counts from here
    run.dispatch.restore(merged, attempts, max([*merged, *(m["epoch"] for m in pending), 0]))
    for epoch, (step, version) in ends.items():  # epochs finished before the restart
        run.ledger.epoch_end[epoch] = (step, float("nan"))
        if run.spec.validation is not None:
            run.submit_validation(version, step)
    logger.info(
        "run %s resumed at step %d: %d updates merged before, %d uploaded but unmerged",
        run.id,
        run.server.step,
        sum(map(len, merged.values())),
        len(pending),
    )
    for meta in pending:
        run.dispatch.take(meta["epoch"], meta["shard"])
        rec = {"seconds": float("nan"), "upload_seconds": float("nan"), **meta}
        await arrivals.update(
            run, rec, TaskRecord("update", meta["epoch"], meta["shard"], meta["attempt"], meta["base_step"])
        )
    run.close_epochs()
