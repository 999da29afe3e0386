"""The live displays' model of a run: :class:`PanelState`, the fold of one snapshot and the events after it.

The notebook panel (:mod:`vcdask.panel`) and the console display (:mod:`vcdask.progress`) both render
it; it imports neither (and nothing of ipywidgets or bokeh).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PanelState", "ended_snapshot"]

_MAX_GRID_EPOCHS = 8  # the shard grid shows the newest epochs only
_ENDED = ("finished", "error", "cancelled")  # a run's status once it has ended (``RunHandle.done``)


def ended_snapshot(handle: Any) -> dict[str, Any] | None:
    """The panel's snapshot of ``handle``'s run (as the scheduler's ``vcdask_panel`` gives it) made of the
    result the handle kept, once the run has ended and the handle has closed its client; None otherwise (the
    panel asks the scheduler)."""
    import pickle

    from .engine.views import panel_metric
    from .spec import load_spec

    res = handle._res
    if res is None or not handle._closed:
        return None
    shards: dict[tuple[int, int], str] = {}
    for row in res.get("history") or ():  # the grid's final states: merged, or skipped
        if row["accepted"] or row["outcome"] == "skipped":
            where = (row["epoch"], row["shard"])
            shards[where] = "merged" if row["accepted"] else shards.get(where, "skipped")
    return {
        "status": handle.status(),
        "epochs": list(res.get("epochs") or ()),
        "workers": list(res.get("workers") or ()),
        "shards": [[e, s, state] for (e, s), state in shards.items()],
        "metric": panel_metric(load_spec(pickle.loads(res["store"]), handle.run_id)),
    }


class PanelState:
    """The panel's model: a fold of one snapshot of the run and the events that follow it.

    Every event carries absolute values (a shard's new state, a worker's whole row, an epoch's
    whole row), so applying an event twice, or one the snapshot already includes, is harmless.
    """

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.status: dict[str, Any] = {"status": "starting"}
        self.epochs: dict[int, dict] = {}
        self.workers: dict[str, dict] = {}
        self.lost: set[str] = set()
        self.shards: dict[tuple[int, int], str] = {}
        self.metric = "accuracy"
        self.last_update: dict[str, Any] = {}
        self.paused: str | None = None
        self.notes: list[str] = []  # recent notable events, newest last
        self.events = 0  # events folded in so far

    @property
    def n_shards(self) -> int:
        return int(self.status.get("n_shards") or 0)

    @property
    def epochs_done(self) -> int:
        return len(self.epochs)

    @property
    def ended(self) -> bool:
        """Whether the run has ended (finished, failed or cancelled): no more events will come."""
        return self.status.get("status") in _ENDED

    def apply_snapshot(self, snap: dict) -> None:
        self.status.update(snap["status"])
        self.metric = snap.get("metric", self.metric)
        for row in snap["epochs"]:
            self.epochs[int(row["epoch"])] = row
        for row in snap["workers"]:
            self.workers[row["worker"]] = row
        for epoch, shard, state in snap["shards"]:
            self.shards[(int(epoch), int(shard))] = state
        self.paused = snap["status"].get("paused")

    def apply(self, event: dict) -> None:
        kind = event.get("type")
        self.events += 1
        if "worker_row" in event:
            row = event["worker_row"]
            self.workers[row["worker"]] = row
        if kind == "shard":
            self.shards[(int(event["epoch"]), int(event["shard"]))] = event["state"]
            if event["state"] == "skipped":  # (on_shard_failure="skip": the run goes on without it)
                why = event.get("why") or f"shard {event['shard']} of epoch {event['epoch']} failed"
                self._note(f"skipped: {why}")
        elif kind == "update":
            self.last_update = event
            if event.get("accepted"):
                self.status["step"] = event["new_version"]
                self.status["version"] = event.get("version") or self.status.get("version")
                self.status["alpha"] = event.get("alpha")
                self.status["staleness"] = event.get("staleness")
                self.status["merge"] = event.get("merge") or self.status.get("merge")
        elif kind == "epoch":
            self.epochs[int(event["epoch"])] = {k: v for k, v in event.items() if k not in ("type", "run_id")}
            self.status["epochs_done"] = len(self.epochs)
        elif kind == "lost":
            self.lost.add(event["worker"])
            self._note(
                f"worker {event['worker']} lost while training shard {event['shard']} "
                f"of epoch {event['epoch']}: shard re-queued"
            )
        elif kind == "reissue":
            self._note(
                f"shard {event['shard']} of epoch {event['epoch']} {event['why']} on {event['worker']}: re-issued"
            )
        elif kind == "excluded":
            self._note(f"worker {event['worker']} excluded: {event['reason']}")
        elif kind == "preempted":
            self._note(f"worker {event['worker']} preempted: {event['reissued']} shard(s) moved")
        elif kind == "paused":
            workers = event.get("cause") == "workers"
            self.paused = event["why"] if workers else f"store unavailable: {event['why']}"
            self._note(f"paused: {self.paused}")
        elif kind == "resumed":
            self.paused = None
            what = "workers" if event.get("cause") == "workers" else "store"
            self._note(f"{what} back after {event['after']:.0f} s: continuing")
        elif kind in ("finished", "failed", "started"):
            self.status["status"] = {"finished": "finished", "failed": "error", "started": "running"}[kind]
            if kind == "failed":  # the error's last line (its traceback's message), if it has one
                lines = str(event.get("error") or "").strip().splitlines()
                self._note("run failed" + (f": {lines[-1]}" if lines else ""))

    def apply_status(self, status: dict) -> None:
        """A status polled by a waiting ``fit`` (cheap counters; the panel's content comes from events)."""
        self.status.update(status)
        self.paused = status.get("paused")

    def _note(self, text: str) -> None:
        self.notes = [*self.notes[-4:], text]

    # -- views of the state (what the widgets draw; also what tests check) -----------------
    def grid_epochs(self) -> list[int]:
        epochs = sorted({e for e, _ in self.shards})
        return epochs[-_MAX_GRID_EPOCHS:]

    def grid(self, epoch: int) -> list[str]:
        """The state of each shard of ``epoch``, in shard order.  Once the run has ended, a copy still out
        (cancelled at the end: no event says so) is not running: its shard shows as not run, "queued"."""
        states = [self.shards.get((epoch, s), "queued") for s in range(self.n_shards)]
        if self.ended:
            states = ["queued" if s in ("running", "re-issued") else s for s in states]
        return states

    def metric_series(self) -> dict[str, list]:
        """One point per finished epoch: wall time, the metric of its last version, and its band."""
        m = self.metric
        # epochs overlap (a straggler may end epoch e after epoch e+1): the line runs in time order
        rows = sorted(self.epochs.values(), key=lambda r: (float(r.get("wall_time", 0.0)), int(r["epoch"])))
        value = [float(r.get(m, float("nan"))) for r in rows]
        return {
            "epoch": [int(r["epoch"]) for r in rows],
            "time": [float(r.get("wall_time", 0.0)) for r in rows],
            "value": value,
            "lo": [float(r.get(f"{m}_min", v)) for r, v in zip(rows, value, strict=True)],
            "hi": [float(r.get(f"{m}_max", v)) for r, v in zip(rows, value, strict=True)],
        }

    def worker_rows(self) -> list[dict]:
        rows = []
        for address, row in sorted(self.workers.items()):
            state = (
                "excluded"
                if row.get("excluded")
                else "preempted"
                if row.get("preempted")
                else "lost"
                if address in self.lost
                else "active"
            )
            rows.append({**row, "state": state})
        return rows
