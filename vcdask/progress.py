"""Following a run: the fold of its events (:class:`PanelState`), and the console display.

:func:`make_progress` picks a display: the live notebook panel (:mod:`vcdask.panel`) in Jupyter,
a tqdm bar with log lines elsewhere.  Both follow the run's events (its Dask topic,
:func:`vcdask.engine.events.topic`); the console form prints the notable ones (re-issues, lost or
excluded workers, store pauses) as concise lines above its bar.  Nothing here imports ipywidgets.
"""

from __future__ import annotations

import logging
from typing import Any

from .engine.events import topic

__all__ = ["ConsoleProgress", "PanelState", "make_progress"]

logger = logging.getLogger(__name__)

_MAX_GRID_EPOCHS = 8  # the shard grid shows the newest epochs only


class _NoProgress:
    def update(self, status: dict) -> None:
        pass

    def close(self, status: dict | None = None) -> None:
        pass


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
        elif kind == "update":
            self.last_update = event
            if event.get("accepted"):
                self.status["step"] = event["new_version"]
                self.status["version"] = event.get("version") or self.status.get("version")
                self.status["alpha"] = event.get("alpha")
                self.status["staleness"] = event.get("staleness")
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
            if kind == "failed":
                self._note("run failed: " + str(event.get("error", "")).strip().splitlines()[-1])

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
        """The state of each shard of ``epoch``, in shard order."""
        return [self.shards.get((epoch, s), "queued") for s in range(self.n_shards)]

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


class ConsoleProgress:
    """A tqdm bar (one unit per epoch; the postfix shows merges in the epoch and the last metrics),
    with a line for each notable event of the run."""

    def __init__(self, handle):
        from tqdm.auto import tqdm

        status = handle.status()
        self.bar = tqdm(total=status["max_epochs"], unit="epoch", desc=status["run_id"], leave=True)
        self.done = 0
        self.client = handle.client
        self.topic = topic(handle.run_id)
        self.state = PanelState(handle.run_id)
        self._subscribed = False
        try:
            self.client.subscribe_topic(self.topic, self._on_event)
            self._subscribed = True
        except Exception:
            logger.debug("could not subscribe to %s", self.topic, exc_info=True)

    def _on_event(self, event) -> None:
        before = list(self.state.notes)
        self.state.apply(event[1])
        for note in self.state.notes:
            if note not in before:
                self.bar.write(f"vcdask {self.state.run_id}: {note}")

    def update(self, status: dict) -> None:
        done = status["epochs_done"]
        if done > self.done:
            self.bar.update(done - self.done)
            self.done = done
        post = {"merged": f"{status['merged_in_epoch']}/{status['n_shards']}", "v": status["step"]}
        for k, v in (status.get("last_epoch") or {}).items():
            if k in ("epoch", "version", "wall_time", "skipped") or k.endswith(("_mean", "_min", "_max")):
                continue
            post[k] = f"{v:.4f}"
        if status.get("paused"):
            post["paused"] = status.get("paused_cause") or "store"
        self.bar.set_postfix(post, refresh=True)

    def close(self, status: dict | None = None) -> None:
        if self._subscribed:
            try:
                self.client.unsubscribe_topic(self.topic)
            except (ValueError, KeyError):
                pass
        self.bar.close()


def make_progress(handle, enabled: bool = True):
    """The progress display for ``handle``'s run: a :class:`~vcdask.panel.RunPanel` in a Jupyter
    kernel, a :class:`ConsoleProgress` elsewhere, nothing when ``enabled`` is False."""
    if not enabled:
        return _NoProgress()
    from .panel import RunPanel, in_kernel

    if in_kernel():
        try:
            return RunPanel(handle)
        except ImportError as e:  # ipywidgets / bokeh / jupyter_bokeh missing: fall back to the bar
            logger.warning(
                "the notebook panel needs ipywidgets, bokeh and jupyter_bokeh (%s); showing a progress bar instead", e
            )
    return ConsoleProgress(handle)
