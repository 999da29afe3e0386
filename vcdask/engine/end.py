"""A run's record and why it ended (the run's end itself, :meth:`vcdask.engine.run.Run.drive`, finishes
its work and lets go of everything parameter-sized).

The run's record is a small JSON file beside the run in its store (:func:`vcdask.spec.record_path`):
written ``running`` when the run starts and again when it ends, it is what ``vcdask runs`` lists
without unpickling the run's spec.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..spec import record_path
from ..store._runs import staged_paths, sweep_staged

if TYPE_CHECKING:
    from ..spec import RunSpec
    from .core import RunState

logger = logging.getLogger(__name__)

__all__ = [
    "RELEASE_TIMEOUT",
    "LetGo",
    "SCHEDULER_CLOSED",
    "best_version",
    "cut_off",
    "let_go_of_inputs",
    "progress_at",
    "progress_of",
    "read_record",
    "record",
    "release_on_workers",
    "resumes_as_running",
    "running_record",
    "save_record",
    "sweep_staged_data",
    "stop_kind",
    "write_record",
]

#: How long a run's end waits for its workers to let go of what they keep for it (seconds; a healthy worker
#: answers in milliseconds, a frozen one would hold the run's end back until then).
RELEASE_TIMEOUT = 2.0


#: Why a run ended whose scheduler closed under it (``close_embedded()``, the interpreter's exit, a scheduler shut
#: down): its ``stopping``; the run is not over (its ``stop_kind`` is ``shutdown``), ``vcdask.resume`` continues it.
SCHEDULER_CLOSED = "its scheduler closed"


def stop_kind(status: str, stopping: str | None) -> str | None:
    """Why a run ended, in one word: ``max_epochs``, ``target``, ``patience``, ``user`` (stopped with a
    result), ``cancelled`` (:meth:`~vcdask.RunHandle.cancel`), ``shutdown`` (its scheduler closed under it: not
    over, :func:`vcdask.resume` continues it), ``failed``; None while it runs."""
    if status == "cancelled":
        return "shutdown" if stopping == SCHEDULER_CLOSED else "cancelled"
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


def record(run: RunState, res: dict[str, Any]) -> dict[str, Any]:
    """The run's record (JSON-able) from its result dict (reads the store: call it off the event loop);
    with its epoch rows, for a resume (the run's shell adds where its merge thread stands: its ``step`` and
    ``progress``)."""
    kind = stop_kind(res["status"], res["stopping"])
    status = {
        "max_epochs": "finished",
        "cancelled": "cancelled",
        "shutdown": "incomplete",
        "failed": "failed",
        None: "running",
    }.get(kind, "stopped")
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
        "best_version": best_version(run.spec.store, res) if kind not in (None, "failed") else None,
        "start": res.get("start"),
        "started": run.started,
        "ended": run.ended,
        "epochs": list(res.get("epochs") or ()),
        "resumed_at": run.ledger.resumed_at,
        # (what a collection needs to remove the run's staged data once it has ended: vcdask.store._runs)
        "staged": staged_paths((run.spec.train, run.spec.validation)),
        "keep_staged_for": getattr(run.spec.retention, "keep_staged_for", None),
    }


def cut_off(run: RunState) -> None:
    """The run's driver was cancelled: its scheduler closes under it.  It ends ``cancelled`` there, recorded as
    ``shutdown`` (its work is not over: :func:`vcdask.resume` continues it), unless :meth:`~vcdask.RunHandle.cancel`
    was ending it already."""
    from .core import Phase

    run.phase = Phase.CANCELLED
    if not run.cancelled:
        run.stopping = SCHEDULER_CLOSED


def resumes_as_running(rec: Mapping[str, Any]) -> bool:
    """Whether a run's record says its last session did not reach its own end (it runs, it died, or its scheduler
    closed under it): a resume goes on as that session would have (its ``target`` and ``patience`` counting from
    where that session counted)."""
    return rec.get("status") == "running" or rec.get("stop_kind") == "shutdown"


def running_record(run: RunState, scheduler: str | None = None) -> dict[str, Any]:
    """The record written when the run starts, and again as epochs close: ``running`` until it ends
    (``vcdask runs`` shows a run whose record still says so as incomplete: it runs, or it died), with the address
    of the ``scheduler`` that drives it (a resume elsewhere asks it first whether the run still goes on there)."""
    return {
        "run_id": run.id,
        "status": "running",
        "scheduler": scheduler,
        "stop_kind": None,
        "stop_reason": None,
        "epochs_done": len(run.ledger.epochs),
        "max_epochs": run.spec.max_epochs,
        "start": run.spec.start,
        "started": run.started,
        "epochs": _rows(run),  # (for a resume after a crash: what each epoch measured)
        "resumed_at": run.ledger.resumed_at,  # (a crash of an extended run: it goes on counting from there)
    }


def _rows(run: RunState) -> list[dict[str, Any]]:
    """The epoch rows so far: those an earlier session closed (a resumed run's), and this session's."""
    rows = {**run.ledger.restored, **{int(r["epoch"]): r for r in run.ledger.epochs}}
    return [rows[e] for e in sorted(rows)]


def write_record(store: Any, run_id: str, rec: dict[str, Any]) -> None:
    store.files.put(record_path(run_id), json.dumps(rec, default=str).encode())


def save_record(store: Any, run_id: str, make: Callable[[], dict[str, Any]]) -> None:
    """Write the record ``make()`` builds (:func:`write_record`), logging a failure rather than raising it:
    the run goes on (or ends) without it, and its next epoch, or its end, writes it again."""
    try:
        write_record(store, run_id, make())
    except Exception:
        logger.warning("run %s: could not write its record %s", run_id, record_path(run_id), exc_info=True)


def progress_of(store: Any, run_id: str, version: str | None, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The run's progress: its record's, when the record was written with every merge in ``version``, the branch's
    newest (``metadata``: that version's; the record adds what the run did after its last commit, such as a
    shard given up), else the newest version's own."""
    recorded = progress_at(read_record(store, run_id) or {}, version)
    return recorded if recorded is not None else dict(metadata.get("progress") or {})


def progress_at(rec: Mapping[str, Any], version: str | None) -> dict[str, Any] | None:
    """The progress a run's record ``rec`` holds if it was written with every merge in ``version`` (the branch's
    newest: nothing was committed since, so the record's is the newer), else None."""
    progress = rec.get("progress")
    if isinstance(progress, dict) and version is not None and rec.get("progress_on") == version:
        return dict(progress)
    return None


def sweep_staged_data(store: Any, run_id: str) -> None:
    """At the end of run ``run_id``: remove the staged data of the store's ended runs whose time is up, each by
    its own ``Retention.keep_staged_for`` (:func:`vcdask.store._runs.sweep_staged`); a failure is logged."""
    try:
        sweep_staged(store.files)
    except Exception:  # (the run's result does not depend on it; the next run's end, or a gc, tries again)
        logger.warning("run %s: could not remove the staged data of ended runs", run_id, exc_info=True)


def read_record(store: Any, run_id: str) -> dict[str, Any] | None:
    """The run's record, or None when it has none (a run of an earlier vcdask, or one that never started)
    or none that reads (cut short by a crash of a vcdask that wrote a local record in place: a warning
    says so, and the caller goes by the run's versions)."""
    path = record_path(run_id)
    if not store.files.exists(path):
        return None
    data = store.files.get(path)
    try:
        rec = json.loads(data)
    except ValueError as e:
        logger.warning("run %s: its record %s (%d bytes) does not read, left out: %s", run_id, path, len(data), e)
        return None
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


async def release_on_workers(scheduler: Any, run_id: str, workers: Iterable[str]) -> None:
    """Ask ``workers`` (those that trained for run ``run_id`` and are still connected) to let go of what they
    keep for it (:func:`vcdask._held.release_run`: model copies, optimizer states and hand-overs, on their
    GPUs, and their cached memory).  Best effort: a worker that has not answered in :data:`RELEASE_TIMEOUT`
    seconds, or fails, keeps them until its caches' bounds evict them, and the run ends as it would have."""
    connected = getattr(scheduler, "workers", None) or {}
    targets = [w for w in workers if w in connected]
    if not targets or not hasattr(scheduler, "broadcast"):
        return
    from distributed.protocol.pickle import dumps

    from .._held import release_run

    msg = {"op": "run", "function": dumps(release_run), "args": dumps((run_id,)), "wait": True}
    try:
        await asyncio.wait_for(scheduler.broadcast(msg=msg, workers=targets, on_error="ignore"), RELEASE_TIMEOUT)
    except Exception:  # (best effort: the workers' caches are bounded anyway)
        logger.debug("run %s: the workers did not all let go of its caches", run_id, exc_info=True)


@dataclasses.dataclass(frozen=True)
class LetGo:
    """What an ended run keeps of a data source: its size (whether it had one is what its views read)."""

    n: int


def let_go_of_inputs(spec: RunSpec) -> RunSpec:
    """``spec`` without its model and data, which an ended run no longer needs.

    A map-style Dataset is the whole dataset, and the embedded scheduler is the notebook's process, which
    keeps every ended run, up to ``ended-runs-kept`` of them: each would keep its data.
    """

    def kept(source: Any) -> LetGo | None:
        return None if source is None else LetGo(int(getattr(source, "n", 0)))

    released: dict[str, Any] = {"model": None, "train": kept(spec.train), "validation": kept(spec.validation)}
    return dataclasses.replace(spec, **released)
