"""``vcdask versions``, ``runs``, ``tags`` and ``gc``: what a store holds, read from the versions' metadata."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from ..errors import StoreNotFoundError, VersionNotFoundError
from ._errors import CommandError, missing_store

__all__ = ["gc", "human", "open_store_for", "run_info", "runs", "tags", "versions"]

HIDDEN_BRANCHES = ("vcdask.keep.", "vcdask.hold.")


def human(nbytes: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def open_store_for(args: argparse.Namespace, mode: str = "r") -> Any:
    """The store named on the command line, opened with its storage options."""
    from .. import open_store

    try:
        return open_store(args.store, mode=mode, **args.storage_options)
    except StoreNotFoundError as e:
        raise missing_store(args.store, e) from None


def run_ids(store: Any, names: Iterable[str] | None = None) -> list[str]:
    """The runs in ``store``, oldest first: branches with a run spec (run ids start with their start time).
    ``names``: its branches, listed already (:func:`~vcdask.store._history.branch_names`; default: listed now;
    no branch's head is looked up)."""
    from ..spec import spec_path
    from ..store._history import branch_names

    listed = branch_names(store) if names is None else names
    runs = [b for b in listed if not b.startswith(HIDDEN_BRANCHES) and b != "main"]
    return sorted(b for b in runs if store.files.exists(spec_path(b)))


def _when(t: datetime | None) -> str:
    return f"{t:%Y-%m-%d %H:%M:%S}" if t else "-"


# -- versions ---------------------------------------------------------------------------------------------
def versions(args: argparse.Namespace) -> int:
    store = open_store_for(args)
    branch = args.branch or args.run
    if branch is None:
        runs = run_ids(store)
        branch = runs[-1] if runs else "main"
    elif args.run is not None and args.run not in store.branches():
        raise CommandError(f"no run {args.run!r} in {store.location!r}; runs: {run_ids(store)}")
    by_version: dict[str, list[str]] = {}
    for name, version in store.tags().items():
        by_version.setdefault(version, []).append(name)
    listed = store.versions(branch)
    print(f"{'version':20}  {'written (UTC)':19}  {'step':>6}  {'epoch':>5}  {'size':>10}  message")
    for info in listed[: args.limit]:
        meta = info.metadata
        tag = f"  [{', '.join(by_version[info.id])}]" if info.id in by_version else ""
        try:
            size = human(store.version_nbytes(info.id))
        except VersionNotFoundError:  # collected since it was listed (a run's retention, a gc): listed as it was
            size = "removed"
        step, epoch = meta.get("step", ""), meta.get("epoch", "")
        print(f"{info.id}  {_when(info.written_at)}  {step:>6}  {epoch:>5}  {size:>10}  {info.message}{tag}")
    more = f" ({len(listed) - args.limit} more: --limit)" if len(listed) > args.limit else ""
    print(f"{len(listed)} versions on {branch!r}{more}; the whole store holds {human(store.store_nbytes())}")
    return 0


# -- runs -------------------------------------------------------------------------------------------------
def run_info(store: Any, run_id: str, versions: list[Any] | None = None) -> dict[str, Any]:
    """What a run's record (``runs/<run_id>/status.json``, written by the engine), its versions' metadata
    and, for ``vcdask train`` runs, its job record say about it; never unpickles the run's spec.  ``versions``:
    the run's versions, read already (default: ``store.versions(run_id)``)."""
    from ..engine.end import read_record

    listed = store.versions(run_id) if versions is None else versions
    head = listed[0] if listed else None
    meta = head.metadata if head else {}
    done = meta.get("progress", {}).get("done", [])
    epochs = len(done)  # epochs may finish out of order: [[2, 3], [1, 4]] is two epochs done
    record = _record(store, run_id, read_record)
    if record.get("status") not in (None, "running") and isinstance(record.get("epochs_done"), int):
        # an ended run's: its result's epochs (one merged after an early stop or a Ctrl-C is not one of them)
        epochs = record["epochs_done"]
    first = listed[-1].metadata if listed else {}
    max_epochs = record.get("max_epochs") or first.get("max_epochs")
    job = _job_record(store, run_id)
    start = first.get("start") or record.get("start") or (job or {}).get("recorded_start") or (job or {}).get("start")
    metric = record.get("metrics") or _final_metric(meta, job)
    status = run_status(record)
    return {
        "run_id": run_id,
        "started": _started(record, listed),
        "status": status,
        "epochs": epochs,
        "max_epochs": max_epochs,
        "step": meta.get("step"),
        "version": head.id if head else None,
        "versions": len(listed),
        "metric": metric,
        "size": store.version_nbytes(head.id) if head else 0,
        "start": _start_name(start),
        "released": ((job or {}).get("release") or {}).get("tag"),
    }


def _started(record: dict[str, Any], listed: list[Any]) -> datetime | None:
    """When the run started: its record's ``started`` (epoch seconds), or its oldest version's time, whichever
    is earlier (a retention policy may have removed its first versions; a resumed run's record says when it
    was resumed)."""
    times = [listed[-1].written_at] if listed else []
    started = record.get("started")
    if isinstance(started, (int, float)) and not isinstance(started, bool):
        times.append(datetime.fromtimestamp(started, UTC))
    return min(times, default=None)


def _record(store: Any, run_id: str, read_record: Any) -> dict[str, Any]:
    try:
        return read_record(store, run_id) or {}
    except (ValueError, OSError):  # a damaged record: list the run from its versions
        return {}


def run_status(record: dict[str, Any]) -> str:
    """What ``vcdask runs`` shows: ``finished``, ``stopped early (target)``, ``stopped early (patience)``,
    ``stopped (by the user)``, ``cancelled``, ``failed``, ``incomplete (shut down)`` (its scheduler closed under
    it: ``vcdask.cluster.close_embedded()``, a scheduler shut down), or ``incomplete`` (no end recorded: the run
    is still going, or its scheduler died or closed at the interpreter's exit).  ``vcdask.resume(run_id)``
    continues an incomplete run."""
    kind = record.get("stop_kind")
    if kind == "shutdown":
        return "incomplete (shut down)"
    if record.get("status") in (None, "running") or kind is None:
        return "incomplete"
    if kind in ("target", "patience"):
        return f"stopped early ({kind})"
    if kind == "user":
        return "stopped (by the user)"
    return {"max_epochs": "finished"}.get(kind, kind)


def _job_record(store: Any, run_id: str) -> dict[str, Any] | None:
    path = f"{run_id}/job.json"
    try:
        job = json.loads(store.files.get(path)) if store.files.exists(path) else None
    except (ValueError, OSError):  # a damaged record: list the run without it
        return None
    return job if isinstance(job, dict) else None


def _final_metric(meta: dict[str, Any], job: dict[str, Any] | None) -> dict[str, float] | None:
    recorded = meta.get("metrics")
    if isinstance(recorded, dict) and recorded:
        return {k: float(v) for k, v in recorded.items()}
    release = (job or {}).get("release")
    if release and release.get("candidate") is not None:
        return {release["metric"]: float(release["candidate"])}
    run_metrics = (job or {}).get("run_metrics")
    return {k: float(v) for k, v in run_metrics.items()} if run_metrics else None


def _start_name(start: Any) -> str | None:
    if not isinstance(start, dict):
        return None
    if start.get("tag"):
        return f"tag {start['tag']}"
    return f"version {start['version']}" if start.get("version") else None


def runs(args: argparse.Namespace) -> int:
    from ..store._history import branch_names, versions_of

    store = open_store_for(args)
    names = branch_names(store)  # (one listing for every run's versions: not one per run)
    ids = run_ids(store, names)
    listed = versions_of(store, ids, names)
    infos = [run_info(store, r, listed.get(r)) for r in reversed(ids)]
    if args.json:
        print(json.dumps(infos, default=str, indent=2))
        return 0
    print(f"{'run':28}  {'started (UTC)':19}  {'status':24}  {'epochs':>7}  {'metric':22}  {'size':>10}  from")
    for i in infos:
        epochs = f"{i['epochs']}/{i['max_epochs'] if i['max_epochs'] is not None else '?'}"
        metric = ", ".join(f"{k}={v:.4g}" for k, v in (i["metric"] or {}).items()) or "-"
        released = f"  released {i['released']}" if i["released"] else ""
        print(
            f"{i['run_id']:28}  {_when(i['started'])}  {i['status']:24}  {epochs:>7}  {metric:22}  "
            f"{human(i['size']):>10}  {i['start'] or 'fresh'}{released}"
        )
    print(f"{len(infos)} runs in {store.location!r}" + ("" if infos else " (runs write branches named run-...)"))
    return 0


# -- tags -------------------------------------------------------------------------------------------------
def tags(args: argparse.Namespace) -> int:
    from ..store._history import branch_names, versions_of

    store = open_store_for(args)
    named = store.tags()
    infos = {}
    names = branch_names(store)  # (one listing for every branch's versions: not one per branch)
    for listed in versions_of(store, sorted(b for b in names if not b.startswith(HIDDEN_BRANCHES)), names).values():
        infos.update({v.id: v for v in listed if v.id in named.values()})
    rows = []
    for name, version in named.items():
        info = infos.get(version) or store.read(version).info
        rows.append(
            {
                "tag": name,
                "version": version,
                "run_id": info.metadata.get("run_id"),
                "step": info.metadata.get("step"),
                "written": info.written_at,
                "size": store.version_nbytes(version),
            }
        )
    rows.sort(key=lambda r: r["written"], reverse=True)
    if args.json:
        print(json.dumps(rows, default=str, indent=2))
        return 0
    print(f"{'tag':20}  {'version':20}  {'run':28}  {'step':>6}  {'written (UTC)':19}  {'size':>10}")
    for r in rows:
        run = r["run_id"] or "-"
        print(
            f"{r['tag']:20}  {r['version']}  {run:28}  {r['step'] if r['step'] is not None else '':>6}  "
            f"{_when(r['written'])}  {human(r['size']):>10}"
        )
    print(f"{len(rows)} tags in {store.location!r}")
    return 0


# -- gc ---------------------------------------------------------------------------------------------------
def gc(args: argparse.Namespace) -> int:
    from .. import Retention
    from ..store._runs import sweep_staged

    policy = Retention(keep_last=args.keep_last, keep_epochs=not args.no_epochs, every=args.every)
    store = open_store_for(args, mode="r" if args.dry_run else "r+")
    before = store.store_nbytes()
    report = _collect(store, policy, args.branch or None, args.dry_run)
    if args.keep_staged_days is not None:  # every run's, whatever its own policy says
        days = args.keep_staged_days * 86400.0
        more = sweep_staged(store.files, args.branch or None, override=days, dry_run=args.dry_run)
        report = dataclasses.replace(report, staged_removed={**report.staged_removed, **more})
    verb = "would remove" if args.dry_run else "removed"
    for branch in sorted(report.kept):
        removed, deferred = report.removed.get(branch, []), report.deferred.get(branch, [])
        later = f", {len(deferred)} later (still needed by another branch or a reader)" if deferred else ""
        print(f"{branch}: keeps {len(report.kept[branch])} versions, {verb} {len(removed)}{later}")
    for run_id, nbytes in sorted(report.staged_removed.items()):
        print(f"{run_id}: {verb} its staged data ({human(nbytes)}): the run ended, and its time is up")
    for why in report.held_back:
        print(f"note: {why}")
    if args.dry_run:
        print(f"dry run: nothing changed; the store holds {human(before)}")
    else:
        print(f"deleted {human(report.bytes_deleted)} in {report.objects_deleted} objects; the store holds ", end="")
        print(f"{human(store.store_nbytes())} (was {human(before)})")
    return 0


def _check_branches(store: Any, branches: list[str] | None) -> None:
    """A :class:`CommandError` (exit 2, nothing there) naming the branches of ``--branch`` that ``store`` lacks."""
    if not branches:
        return
    there = store.branches()
    missing = [b for b in branches if b not in there]
    if missing:
        listed = sorted(b for b in there if not b.startswith(HIDDEN_BRANCHES))
        names = ", ".join(repr(b) for b in missing)
        raise CommandError(f"no branch {names} in {store.location!r}; branches: {listed}")


#: How often ``vcdask gc`` collects again when a run on the same store moved a branch under it.
GC_TRIES = 5


def _collect(store: Any, policy: Any, branches: list[str] | None, dry_run: bool) -> Any:
    """``store.gc``, again (at most :data:`GC_TRIES` times) when a run training on the store committed, or
    collected its own old versions (its retention), while this collection moved the same branch (Icechunk's
    "branch update conflict"), or removed a ref or version this collection had listed (its pins: "ref not
    found", in a store that is there).  Collecting is idempotent: a second pass removes what the first did
    not.  A branch named that the store does not have (or no longer has) is no race: a :class:`CommandError`
    (exit 2) names it at once."""
    import time

    from ..errors import StoreConflict, StoreError

    tries = 1
    _check_branches(store, branches)
    while True:
        try:
            return store.gc(policy, branches=branches, dry_run=dry_run)
        except (StoreError, VersionNotFoundError) as e:
            if isinstance(e, VersionNotFoundError):
                _check_branches(store, branches)  # (a branch named deleted meanwhile is not a race to retry)
            gone = isinstance(e, (StoreConflict, StoreNotFoundError, VersionNotFoundError))
            if not gone and "branch update conflict" not in str(e):
                raise
            if tries == GC_TRIES:
                raise StoreConflict(
                    f"{e}: {GC_TRIES} times a writer on the store (a run's commits or its own retention) moved a "
                    "branch while vcdask gc collected it; run vcdask gc again later, or once the run has ended"
                ) from None
        time.sleep(0.2 * tries)
        tries += 1
