"""The end of a run: finish (cancel what is out, commit, validate, collect), write the run's record,
and let go of everything parameter-sized, so a scheduler that hosts many runs (the embedded one in a
notebook) keeps only their small results.

The run's record is a small JSON file beside the run in its store (:func:`vcdask.spec.record_path`):
written ``running`` when the run starts and again when it ends, it is what ``vcdask runs`` lists
without unpickling the run's spec.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from ..spec import record_path
from . import faults, validations, views, watch

if TYPE_CHECKING:
    from .run import Run

logger = logging.getLogger(__name__)

__all__ = ["best_version", "finish", "read_record", "release", "stop_kind", "write_record"]


async def finish(run: Run) -> None:
    """Cancel the copies still out (and the results handed over but not merged), commit what is
    merged, validate the head, drop the run's updates (unless kept) and apply its retention once more."""
    why = f"cancelled: {run.stopping or 'run finished'}"
    for handed, _ in run.tasks.handed:  # results handed over after the last merge the run needed
        if handed.kind == "update":
            run.ledger.record_copy(handed, "cancelled", why)
            run.handshake.settled += 1  # turned down: no task asking for its base waits for it
    run.tasks.handed.clear()
    run.handshake.note_settled()
    leftover = [k for k, _ in run.tasks.updates()]
    await run.tasks.cancel(leftover)
    for key in leftover:
        task = run.tasks.pop(key)
        if task is not None:
            run.ledger.record_copy(task, "cancelled", why)
    await run.lane.commit()
    head = run.server.head
    if run.spec.validation is not None and head.step not in run.ledger.validations:
        await validations.final(run, head.version, head.step)
    await run.lane.drain()  # (the merged updates' deletes: before the rest is dropped)
    if not run.spec.keep_updates:
        await run.lane.call(faults.drop_run_updates, run.store, run.id)
    await run.lane.collect(final=True, in_use_step=watch.in_use_step(run))  # the run's retention, once more at the end
    run.status = "cancelled" if run.cancelled else "finished"
    run.events.emit("finished", version=head.version, step=head.step, reason=run.stopping or "max_epochs")


async def release(run: Run) -> None:
    """After the run ended: close its client, write its record, keep its small result dict and drop
    ``W_s``, the rule's state, the bases and the spec's model."""
    try:
        await run.tasks.close()
    except Exception:
        logger.debug("closing the client of run %s", run.id, exc_info=True)
    run.ended = time.time()
    run.final = views.result_dict(run)
    try:
        await run.lane.call(_write_final_record, run, run.final)  # best_version lists versions: not on the loop
    except Exception:
        logger.warning("run %s: could not write its record %s", run.id, record_path(run.id), exc_info=True)
    run.lane.shutdown()
    run.server.release()
    run.spec = dataclasses.replace(run.spec, model=None)  # type: ignore[arg-type]


def stop_kind(status: str, stopping: str | None) -> str | None:
    """Why a run ended, in one word: ``max_epochs``, ``target``, ``patience``, ``user`` (stopped with a
    result), ``cancelled``, ``failed``; None while it runs."""
    if status == "cancelled":
        return "cancelled"
    if status == "error":
        return "failed"
    if status != "finished":
        return None
    if stopping is None:
        return "max_epochs"
    if stopping.startswith("target"):
        return "target"
    if stopping.startswith("early stopping"):
        return "patience"
    return "user"


def record(run: Run, res: dict[str, Any]) -> dict[str, Any]:
    """The run's record (JSON-able) from its result dict (reads the store: call it off the event loop)."""
    kind = stop_kind(res["status"], res["stopping"])
    status = {"max_epochs": "finished", "cancelled": "cancelled", "failed": "failed", None: "running"}.get(
        kind, "stopped"
    )
    error = (res.get("error") or "").strip().splitlines()
    return {
        "run_id": run.id,
        "status": status,
        "stop_kind": kind,
        "stop_reason": res["stopping"] if kind != "failed" else (error[-1] if error else None),
        "epochs_done": res["epochs_done"],
        "max_epochs": res["max_epochs"],
        "step": res["step"],
        "version": res["version"],
        "metrics": res.get("final_metrics") or {},
        "monitor": res.get("monitor"),
        "best": res.get("best"),
        "best_version": best_version(run.store, res) if kind not in (None, "failed") else None,
        "start": res.get("start"),
        "started": run.started,
        "ended": run.ended,
    }


def _write_final_record(run: Run, res: dict[str, Any]) -> None:
    write_record(run.store, run.id, record(run, res))


def running_record(run: Run) -> dict[str, Any]:
    """The record written when the run starts: ``running`` until it ends (``vcdask runs`` shows a run
    whose record still says so as incomplete: it runs, or it died)."""
    return {
        "run_id": run.id,
        "status": "running",
        "stop_kind": None,
        "stop_reason": None,
        "epochs_done": len(run.ledger.epochs),
        "max_epochs": run.spec.max_epochs,
        "start": run.spec.start,
        "started": run.started,
    }


def write_record(store: Any, run_id: str, rec: dict[str, Any]) -> None:
    store.files.put(record_path(run_id), json.dumps(rec, default=str).encode())


def read_record(store: Any, run_id: str) -> dict[str, Any] | None:
    """The run's record, or None when it has none (a run of an earlier vcdask, or one that never started)."""
    path = record_path(run_id)
    if not store.files.exists(path):
        return None
    rec = json.loads(store.files.get(path))
    return rec if isinstance(rec, dict) else None


def best_version(store: Any, res: dict[str, Any]) -> str | None:
    """The id of the version that ended the monitored metric's best epoch (None without one)."""
    best = res.get("best")
    if not best:
        return None
    if best["step"] == res["step"]:
        return res["version"]
    for info in store.versions(res["branch"]):
        if info.metadata.get("step") == best["step"]:
            return info.id
    return None  # removed by the run's retention (each epoch's last version is kept by default)
